"""Embedded rollout engine: an HF causal LM and Molt's own batched KV-cache decode loop (why,
re-prefill after a weight update, VL, MoE: docs/scaling.md, "The hf engine"). A background task
decodes same-sampling waves on the loop thread, so `pause`/`update_weights` land between steps.
LoRA adapters (`trainer.lora.sync: adapter`): `hf_lora`; `sampling["adapter"]` names one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AttentionInterface, AutoConfig, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from molt_core import moe, multimodal, weight_sync
from molt_core.engines import SAMPLING_KEYS, Requests, check_sampling, default_stop_ids
from molt_core.engines.hf_lora import Adapters, lora_name
from molt_core.trajectory import Completion, ImageInput

__all__ = ["HFEngine", "SAMPLING_KEYS"]


@dataclass
class _Request:
    prompt: list[int]
    sampling: dict[str, Any]
    stop_ids: frozenset[int]
    future: asyncio.Future
    images: list[ImageInput] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: list[list[list[int]] | None] = field(default_factory=list)  # MoE: per token
    prompt_routed: list[list[list[int]]] | None = None                   # MoE: per prompt token
    finish_reason: str | None = None
    rng: torch.Generator | None = None   # own seed: shares no wave or draw with the engine stream
    adapter: str | None = None           # None: the policy's adapter if loaded, else the base
    pin: dict | None = None              # the adapter version it decodes on (hf_lora)

    def key(self) -> tuple:
        return (*sorted(self.sampling.items()), tuple(sorted(self.stop_ids)), self.rng is None)


class HFEngine:
    def __init__(self, model_path: str, *, dtype: str = "float32", max_batch_size: int = 256,
                 seed: int = 0, num_threads: int = 1, device: str = "cpu",
                 max_adapters: int = 4, keep_versions: bool = False) -> None:
        torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        # requires_grad stays (compute runs under no_grad): frozen bf16 made prefill 2.2x slower
        self.model = multimodal.load_model(model_path, getattr(torch, dtype)).to(self.device).eval()
        moe.keep_router_fp32(self.model)      # as the trainer: weight updates keep each dtype
        if self.device.type == "cpu" and dtype != "float32":         # see _sdpa_rows
            AttentionInterface.register("molt_rows", _sdpa_rows)
            AttentionMaskInterface.register("molt_rows", sdpa_mask)
            self.model.set_attn_implementation("molt_rows")
        elif self.device.type == "cpu" and torch.backends.mkldnn.is_available():
            # aten's fp32 GEMM is MKL's, oneDNN's is ~1.9x as fast on this AMD box at batch 32
            for m in self.model.modules():
                if type(m) is torch.nn.Linear:        # updates copy into the bound parameters
                    m.forward = partial(_linear, m.weight, m.bias)
        config = AutoConfig.from_pretrained(model_path)
        self._image_id = config.image_token_id if multimodal.is_vl(config) else None
        self._banned = multimodal.vision_token_ids(config)    # never sampled
        config = config.get_text_config()
        self.max_positions: int = config.max_position_embeddings
        self.pad_id: int = config.pad_token_id if config.pad_token_id is not None else 0
        self.default_stop_ids = frozenset(default_stop_ids(model_path, config))
        self.max_batch_size = max_batch_size
        gates = moe.moe_gates(self.model)
        self._moe_sentinel = [[-1] * g.top_k for g in gates] if gates else None
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # All names a sender may use (tied aliases included) -> the parameter they update.
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._canonical = {id(p): n for n, p in self.model.named_parameters()}
        self._version = self._base_version = 0
        self.lora = Adapters(self.model, self.device, max_adapters, keep_versions)
        self._wave: list[_Request] = []          # the rows decoding now
        self._weights_epoch = 0                 # bumps on every finished update
        self._update_version: int | None = None  # set while an update is in progress
        self._updated: set[int] = set()          # id() of parameters assigned in this update
        self._paused = False
        self._pending: list[_Request] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_task: asyncio.Task | None = None
        self._requests = Requests()
        self._stats = {"requests": 0, "tokens_generated": 0, "decode_steps": 0, "batches": 0,
                       "prefills": 0, "prefill_tokens": 0, "reprefills": 0, "weight_updates": 0,
                       "max_adapters": max_adapters}

    async def generate(self, prompt_ids: list[int], sampling: dict,
                       images: list[ImageInput] | None = None) -> Completion:
        """`images`: those whose placeholder tokens are in the prompt (VL models)."""
        return await self._submit(prompt_ids, sampling, images)

    async def generate_batch(self, prompts: list[list[int]], samplings: list[dict],
                             images: list[list[ImageInput]] | None = None,
                             request_ids: list[str] | None = None) -> list[Completion | Exception]:
        images = images or [None] * len(prompts)
        futures = []
        for p, s, i in zip(prompts, samplings, images):
            try:
                futures.append(self._submit(p, s, i))
            except Exception as e:   # a bad request fails alone
                futures.append(asyncio.get_running_loop().create_future())
                futures[-1].set_exception(e)
        return await self._requests.gather(futures, request_ids)

    async def abort(self, request_ids: list[str]) -> None:
        """A waiting request never starts, a decoding one leaves its wave before the next token."""
        self._requests.abort(request_ids)

    def _submit(self, prompt_ids: list[int], sampling: dict,
                images: list[ImageInput] | None) -> asyncio.Future:
        """Check and queue one request; its future gets the completion (no task per request).
        `sampling["seed"]` (optional): the request samples from a generator of its own."""
        seed = (sampling := dict(sampling)).pop("seed", None)
        if (adapter := sampling.pop("adapter", None)) not in (None, "base", *self.lora.latest):
            raise ValueError(f"unknown adapter {adapter!r}: this engine holds "
                             f"{sorted(self.lora.latest)} and 'base' (the model without one); "
                             f"name one of them or push it first (tensors '{adapter}/...')")
        sampling, stop = check_sampling(sampling)
        if images and self._image_id is None:
            raise ValueError("this engine's model takes no images (not a VL checkpoint)")
        if self._image_id is not None:      # checked here: a bad request must not fail its wave
            images = images or []
            n, want = prompt_ids.count(self._image_id), sum(im.num_tokens for im in images)
            if n != want:
                raise ValueError(f"prompt has {n} image placeholder tokens but its "
                                 f"{len(images)} images fill {want}")
        if not prompt_ids or len(prompt_ids) >= self.max_positions:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; it needs 1 to "
                             f"{self.max_positions - 1} (max_position_embeddings "
                             f"{self.max_positions})")
        self._bind_loop()
        req = _Request([int(t) for t in prompt_ids], sampling,
                       frozenset(stop) if stop is not None else self.default_stop_ids,
                       asyncio.get_running_loop().create_future(), list(images or []),
                       adapter=adapter)
        if seed is not None:
            req.rng = torch.Generator(device=self.device).manual_seed(int(seed))
        self._pending.append(req)
        self._wakeup.set()
        return req.future

    async def pause(self) -> None:
        self._bind_loop()
        self._paused = True
        self._can_run.clear()

    async def resume(self) -> None:
        self._bind_loop()
        self._paused = False
        if self._update_version is None:
            self._can_run.set()

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]],
                             version: int) -> None:
        """A bucket that fails validation copies nothing (the update stays open; one of LoRA
        tensors, `lora_name`, closes an update of nothing else: decoding goes on)."""
        self._bind_loop()
        if self._update_version is None:
            self._update_version, self._updated, self._sums = version, set(), {}
            self.lora.staged = {}
        elif version != self._update_version:
            raise RuntimeError(f"weight bucket for version {version} arrived while the update to "
                               f"version {self._update_version} is unfinished")
        if lora := [(n, t) for n, t in named_tensors if lora_name(n)]:
            with self._closing_on_error():
                self._sums.update(self.lora.stage(lora, version))
            named_tensors = [(n, t) for n, t in named_tensors if not lora_name(n)]
        if named_tensors:
            self._can_run.clear()
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"unknown parameter '{name}' in weight update to version "
                                 f"{version}; engine parameters: "
                                 f"{', '.join(sorted(self._canonical.values()))}")
            if tuple(tensor.shape) != tuple(param.shape) or tensor.dtype != param.dtype:
                raise ValueError(f"parameter '{name}': engine has {tuple(param.shape)} "
                                 f"{param.dtype}, update sent {tuple(tensor.shape)} {tensor.dtype}")
        with torch.no_grad():
            for name, tensor in named_tensors:
                self._params[name].copy_(tensor)
                self._updated.add(id(self._params[name]))
        names = [n for n, _ in named_tensors]      # what the parameters now hold
        self._sums.update(zip(names, weight_sync.checksums([(n, self._params[n]) for n in names])))

    async def weight_group_info(self) -> tuple[int, str]:
        import ray
        return 1, ray.util.get_node_ip_address()

    async def join_weight_group(self, host: str, port: int, rank: int, world_size: int,
                                backend: str, timeout_s: float) -> None:
        self._group = await asyncio.to_thread(weight_sync.WeightGroup, host, port, rank,
                                              world_size, backend, timeout_s)

    async def receive_weights(self, metas: list[weight_sync.Meta], version: int) -> None:
        """Received off the event loop, so decoding goes on meanwhile."""
        if getattr(self, "_group", None) is None:
            raise RuntimeError("receive_weights before join_weight_group")
        named = await asyncio.to_thread(self._group.receive, metas)
        await self.update_weights(named, version)

    async def receive_shm(self, path: str, nbytes: int, metas: list[weight_sync.Meta],
                          version: int) -> None:
        """Each slot is mapped on first use; the two latest stay mapped."""
        maps = self.__dict__.setdefault("_shm", {})
        if path not in maps:
            maps[path] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            if len(maps) > 2:
                del maps[next(iter(maps))]
        await self.update_weights(weight_sync.unpack(maps[path], metas), version)

    async def finish_weight_update(self, version: int) -> dict[str, int]:
        """The update's checksums of each assigned parameter (`weight_sync.send` checks them)."""
        if self._update_version != version:
            raise RuntimeError(f"finish_weight_update({version}) but the update in progress is "
                               f"{self._update_version}")
        self._bind_loop()
        missing = [n for i, n in self._canonical.items() if i not in self._updated]
        if missing and (self._updated or not self.lora.staged):
            raise RuntimeError(f"weight update to version {version} did not assign "
                               f"{len(missing)} parameter(s): {', '.join(missing)}")
        with self._closing_on_error():  # keep_versions: rows go on with theirs unless evicted
            evicted = False
            for aid in list(self.lora.staged):
                evicted |= self.lora.install(aid, version, [r.pin for r in self._wave])
        self._version, self._update_version = version, None
        self._base_version = version if self._updated else self._base_version
        self._weights_epoch += not self.lora.keep or bool(self._updated) or evicted
        self._stats["weight_updates"] += 1
        if not self._paused:
            self._can_run.set()
        return self._sums

    @contextmanager
    def _closing_on_error(self) -> Iterator[None]:
        """A bad adapter leaves the update; one with nothing else left is closed."""
        try:
            yield
        except ValueError:
            if not self.lora.staged and not self._updated:
                self._update_version = None
                if not self._paused:
                    self._can_run.set()
            raise

    async def weight_checksums(self) -> dict[str, int]:
        """`weight_sync.checksums` of every parameter and adapter tensor (names a corrupt one)."""
        named = [(n, self._params[n]) for n in self._canonical.values()]
        named += [nt for ad in self.lora.latest.values() for nt in ad["named"].items()]
        return dict(zip([n for n, _ in named], weight_sync.checksums(named)))

    async def score(self, token_ids: list[int], adapter: str | None = None) -> list[float]:
        """Log-probs of token_ids[1:] after their prefixes at temperature 1 under `adapter` (default
        the policy's): the weight-sync canary (`EngineRestarts.check_canary`); RNG untouched."""
        ids = torch.tensor([token_ids], device=self.device)
        self.lora.groups = self.lora.group([self.lora.resolve(adapter)])
        with torch.no_grad(), moe.routing(self.model, mode="off"):
            logits = self.model(input_ids=ids).logits[0, :-1].float()
        if self._banned:
            logits[:, self._banned] = -float("inf")
        return logits.log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1).tolist()

    async def rng_state(self) -> torch.Tensor:
        """The sampling RNG (checkpointed, so a resumed sync run samples what it would have)."""
        return self.generator.get_state()

    async def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    async def get_version(self) -> int:
        return self._version

    async def stats(self) -> dict:
        return {**self._stats, "version": self._version, "paused": self._paused,
                **self.lora.stats([r.pin for r in self._wave]),
                "pending": len(self._pending), "updating": self._update_version is not None}

    def _bind_loop(self) -> None:
        """Create the events and the decode task on the running loop (Ray actor or asyncio.run)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._loop = loop
        self._can_run = asyncio.Event()     # open unless paused or mid-update
        if not self._paused and self._update_version is None:
            self._can_run.set()
        self._wakeup = asyncio.Event()
        self._pending = []                  # requests of a closed loop cannot be answered
        self._loop_task = loop.create_task(self._decode_loop())  # keep a reference: tasks are weak

    async def _decode_loop(self) -> None:
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            for _ in range(20):     # let concurrent arrivals gather so they share one wave
                n = len(self._pending)
                await asyncio.sleep(0.001)
                if n == len(self._pending):
                    break
            self._pending = [r for r in self._pending if not r.future.cancelled()]  # aborted
            if not self._pending:
                continue
            key = self._pending[0].key()
            wave = [r for r in self._pending if r.key() == key][: self.max_batch_size]
            taken = {id(r) for r in wave}
            self._pending = [r for r in self._pending if id(r) not in taken]
            try:
                await self._run_wave(wave)
            except Exception as e:  # a failed wave fails its requests, not the engine
                for r in wave:
                    if not r.future.done():
                        r.future.set_exception(e)
            self._wave = []

    async def _run_wave(self, wave: list[_Request]) -> None:
        self._stats["batches"] += 1
        s = wave[0].sampling
        rows: list[_Request] = []
        epoch = -1
        while True:
            await self._can_run.wait()
            if epoch != self._weights_epoch:
                # Fresh wave or new weights: (re)build the KV cache from prompt + tokens so far.
                if not (rows := [r for r in wave if r.finish_reason is None]):
                    return
                for r in rows:      # keep_versions: a live pin stays
                    if r.pin is None or not self.lora.keep or not self.lora.live(r.pin):
                        r.pin = self.lora.resolve(r.adapter)
                self._wave, self._stats["reprefills"] = rows, self._stats["reprefills"] + any(
                    r.tokens for r in rows)
                logits, cache, mask, pos, seen, routed = self._prefill(rows)
                epoch, groups = self._weights_epoch, self.lora.group([r.pin for r in rows])
                if routed is not None:   # [B, L, layers, k]: each token fed so far (left pad)
                    for i, r in enumerate(rows):
                        seq = routed[i, routed.shape[1] - len(r.prompt) - len(r.tokens):].tolist()
                        r.prompt_routed, r.routed = seq[:len(r.prompt)], seq[len(r.prompt):]
            else:
                logits, routed = self._step(next_ids, cache, mask, pos, groups)
                self._stats["decode_steps"] += 1
                if routed is not None:   # [B, layers, k]: the token each row just fed
                    for r, ids in zip(rows, routed.tolist()):
                        if r.finish_reason is None:
                            r.routed[-1] = ids
            tokens, logprobs = self._sample(logits, seen, s, [r.rng for r in rows])
            seen[torch.arange(len(rows)), tokens] = True
            for r, t, lp in zip(rows, tokens.tolist(), logprobs.tolist()):
                if r.finish_reason is None and r.future.cancelled():  # the caller gave up
                    r.finish_reason = "abort"
                if r.finish_reason is not None:
                    continue
                r.tokens.append(t)
                r.logprobs.append(lp)
                r.versions.append(r.pin.get("version", self._base_version))
                r.routed.append(None)
                self._stats["tokens_generated"] += 1
                if t in r.stop_ids:
                    r.finish_reason = "stop"
                elif (len(r.tokens) >= s["max_new_tokens"]
                      or len(r.prompt) + len(r.tokens) >= self.max_positions):
                    r.finish_reason = "length"
                if r.finish_reason is not None:
                    self._stats["requests"] += 1
                    routed = None if self._moe_sentinel is None else [
                        x if x is not None else self._moe_sentinel for x in r.routed]
                    r.future.set_result(Completion(r.tokens, r.logprobs, r.versions,
                                                   r.finish_reason, routed, r.prompt_routed))
            if all(r.finish_reason is not None for r in rows):
                return
            # Finished rows keep decoding a pad token (ignored) so the batch shape stays fixed.
            next_ids = torch.tensor([[self.pad_id if r.finish_reason else r.tokens[-1]]
                                     for r in rows], device=self.device)
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            pos = pos + 1
            await asyncio.sleep(0)

    @torch.no_grad()
    def _prefill(self, rows: list[_Request]) -> tuple:
        # A group's rows share their prompt: each distinct text-only sequence is prefilled once.
        keys = [(tuple(r.prompt + r.tokens), id(r) if r.images else 0, id(r.pin)) for r in rows]
        first: dict = {}
        inv = torch.tensor([first.setdefault(k, len(first)) for k in keys], device=self.device)
        seqs = [torch.tensor(k[0]) for k in first]
        left = {"batch_first": True, "padding_side": "left"}     # [B, L]
        ids = pad_sequence(seqs, padding_value=self.pad_id, **left).to(self.device)
        mask = pad_sequence([torch.ones_like(x) for x in seqs], **left).to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        extra = {}
        if any(r.images for r in rows):    # VL: patches + mRoPE positions [4, B, L] (all distinct)
            images = [im for r in rows for im in r.images]
            pixels = torch.cat([im.pixel_values for im in images]).to(self.device)
            grid = torch.tensor([im.grid_thw for im in images], device=self.device)
            extra = multimodal.model_inputs(self.model, ids, mask, pixels, grid)
            position_ids = extra.pop("position_ids")
        cache = DynamicCache(config=self.model.config)
        pins = dict(zip(keys, (r.pin for r in rows)))     # a key holds its pin's id: one pin
        self.lora.groups = self.lora.group([pins[k] for k in first])
        with moe.routing(self.model, mode="off") as routing:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True, logits_to_keep=1, **extra)
        routed = (routing.ids().view(*ids.shape, *routing.ids().shape[1:])[inv]
                  if self._moe_sentinel is not None else None)
        cache.batch_select_indices(inv)
        ids, mask, position_ids = ids[inv], mask[inv], position_ids[..., inv, :]
        seen = torch.zeros(len(rows), out.logits.shape[-1], dtype=torch.bool, device=self.device)
        seen.scatter_(1, ids, mask.bool())  # [B, V]: tokens present (for repetition penalty)
        self._stats["prefills"] += 1
        self._stats["prefill_tokens"] += sum(len(x) for x in seqs)
        return out.logits[inv, -1], cache, mask, position_ids[..., -1:], seen, routed

    @torch.no_grad()
    def _step(self, next_ids: torch.Tensor, cache: DynamicCache, mask: torch.Tensor,
              pos: torch.Tensor, groups: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        # a dense model skips the routing context (its walk over the modules: ~0.7 ms a step)
        moe_ids = moe.routing(self.model, mode="off") if self._moe_sentinel else nullcontext()
        self.lora.groups = groups
        with moe_ids as routing:
            out = self.model(input_ids=next_ids, attention_mask=mask, position_ids=pos,
                             past_key_values=cache, use_cache=True)
        return out.logits[:, -1], routing.ids() if self._moe_sentinel is not None else None

    @torch.no_grad()
    def _sample(self, logits: torch.Tensor, seen: torch.Tensor, s: dict,
                rngs: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] -> (tokens [B], behavior log-probs [B]) after penalty and temperature."""
        logits = logits.float()
        if self._banned:
            logits[:, self._banned] = -float("inf")
        if s["repetition_penalty"] != 1.0:
            p = s["repetition_penalty"]
            logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
        logits = logits / s["temperature"]
        logprobs = torch.log_softmax(logits, dim=-1)
        # top_k / top_p / min_p shape only the sampling distribution, not the recorded log-prob.
        filtered = logits.clone() if s["top_k"] > 0 or s["top_p"] < 1 or s["min_p"] > 0 else logits
        if s["top_k"] > 0:
            kth = torch.topk(filtered, min(s["top_k"], filtered.shape[-1]), dim=-1).values[:, -1:]
            filtered[filtered < kth] = -float("inf")
        if s["top_p"] < 1.0:
            sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > s["top_p"]  # keeps the token that crosses top_p
            filtered.scatter_(1, order, sorted_logits.masked_fill(drop, -float("inf")))
        if s["min_p"] > 0.0:
            probs = filtered.softmax(-1)
            filtered[probs < s["min_p"] * probs.max(-1, keepdim=True).values] = -float("inf")
        # row by row: [B, V] float64 draws in one go page-fault more than they draw (22 vs 10 ms)
        tokens = torch.stack([_multinomial(p, g or self.generator) for p, g in
                              zip(filtered.softmax(-1), rngs or [None] * len(logits))])
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _sdpa_rows(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs
               ) -> tuple[torch.Tensor, None]:
    """HF's sdpa, but a decode step's G query heads per KV head enter as that head's G rows
    ([B, KV, G, D]): in bf16 the CPU flash kernel takes ~2 ms a layer for [B, H, 1, D] with GQA,
    0.3 ms so (SmolLM2, batch 32); fp32 keeps sdpa's kernel (as fast there)."""
    (b, h, t, d), kv = query.shape, key.shape[1]
    if t > 1 or h == kv:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, kv, h // kv, d), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, h, 1, d).transpose(1, 2), None


def _multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`torch.multinomial(probs, 1)` on CPU, draw for draw (the learning tests' bounds hold on its
    stream): argmax p / q, q = -log1p(-u) ~ Exp(1) from the same uniform doubles, vectorized where
    its exponential_ runs element by element (10 vs 28-50 ms on [32, 49152])."""
    u = torch.rand(probs.shape, dtype=torch.float64, generator=generator, device=probs.device)
    return (probs / u.neg_().log1p_().neg_().to(probs.dtype)).argmax(-1)

