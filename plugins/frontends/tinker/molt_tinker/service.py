"""The service behind the routes: sessions, the training models (each a Molt run with its own
run directory, metrics and checkpoints), the futures every long request returns, and sampling
sessions on the rollout engine.

The live models (at most `max_models`) time-share one policy on one base (`cluster.start`'s): the
policy holds one model's LoRA weights and AdamW state at a time (`resident`); the others' states
wait in CPU memory (`TinkerPolicy.get_state`), and a request of another model swaps them first
(`_use`; a cluster restart when the LoRA rank differs). Training requests of a model run in the
SDK's `seq_id` order, those of all models on one training thread; sampling and the HTTP loop stay
on the event loop. A session that closes or expires frees its models.

A forward_backward computes its log-probs and loss at once (a no-grad forward) and is kept: the
next optim_step trains on all kept rows in one `Policy.train` (`TrainStep`: the Molt loss Tinker's
loss maps to, loss_agg = the plain sum), so its gradient is the sum of theirs at the same
weights. Errors a client caused fail its future with category "user" (the SDK raises
RequestFailedError); the service keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog
import torch

from molt_core import weight_sync
from molt_core.config import Config, to_dict
from molt_tinker import wire
from molt_tinker.wire import UserError

__all__ = ["HTTPError", "Service", "weighted_nll"]

log = structlog.get_logger("molt.tinker")


class HTTPError(Exception):
    """Refused at once with this status (the SDK: 400 BadRequestError, 404 NotFoundError, 410)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def weighted_nll(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                 advantages: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Tinker's cross_entropy per token: -w_t log pi(y_t) (`molt sft`'s nll, weighted; the
    weights ride in `advantages`). [B, T]"""
    return -advantages * logprobs, {}


# Tinker loss -> (Molt loss: registry name or function, its args from loss_fn_config, the
# per-token weight input, defaults); the trainer's pi_old is the sampler's log-probs (`wire`).
LOSSES: dict[str, tuple[Any, Callable[[dict], dict], str, dict]] = {
    "cross_entropy": (weighted_nll, lambda c: {}, "weights", {}),
    "importance_sampling": ("ppo_clip", lambda c: {"clip_low": 1.0, "clip_high": math.inf},
                            "advantages", {}),
    "ppo": ("ppo_clip", lambda c: {"clip_low": 1 - c["clip_low_threshold"],
                                   "clip_high": c["clip_high_threshold"] - 1}, "advantages",
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": ("cispo", lambda c: {"clip_low": 1 - c["clip_low_threshold"],
                                  "clip_high": c["clip_high_threshold"] - 1}, "advantages",
              {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
}


@dataclass
class Session:
    id: str
    last_seen: float
    finished: bool = False


@dataclass
class Model:
    id: str
    session: str
    base_model: str
    rank: int
    seed: int
    next_seq: int = 1
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)
    run_dir: Path | None = None
    kept: list = field(default_factory=list)      # [(rows, loss key)] until the optim_step
    step: int = 0
    sink: Any = None
    log: Any = None
    samplers: int = 0
    state: Any = None       # its weights and AdamW state while another model is resident
    freed: bool = False
    swap_s: float = 0.0     # swap-in time since its last optim_step


class _EngineSlot:
    """The engine and the snapshot it holds: requests of one snapshot run together; another's
    waits until they are done, then its weights go in (`weight_sync.send`, checksummed)."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.key, self.busy = "base", 0
        self.cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def holding(self, key: str, load: Callable[[str], Any]):
        async with self.cond:
            await self.cond.wait_for(lambda: self.engine is not None and (
                self.busy == 0 or self.key == key))
            if self.key != key:
                await asyncio.to_thread(load, key)
                self.key = key
            self.busy += 1
        try:
            yield self.engine
        finally:
            async with self.cond:
                self.busy -= 1
                self.cond.notify_all()

    async def swap(self, engine: Any) -> None:
        """Take the engine away (None) once idle, or put a new one (holding the base weights)."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.busy == 0)
            self.engine, self.key = engine, "base"
            self.cond.notify_all()


class Service:
    def __init__(self, cfg: Config, plugins: Any, names: list[str], *,
                 session_timeout_s: float = 300.0, keep_samplers: int = 4,
                 poll_s: float = 10.0, max_models: int = 8) -> None:
        from molt_core import multimodal
        self.cfg, self.plugins, self.names = cfg, plugins, names
        self.session_timeout_s, self.keep_samplers, self.poll_s, self.max_models = (
            session_timeout_s, keep_samplers, poll_s, max_models)
        from transformers import AutoConfig
        self.tokenizer = multimodal.load_tokenizer(cfg.model.path, cfg.model.chat_template)
        text = AutoConfig.from_pretrained(cfg.model.path).get_text_config()
        self.vocab, self.max_context = text.vocab_size, text.max_position_embeddings
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.resident: Model | None = None              # the model whose state the policy holds
        self.inits: OrderedDict[tuple, dict] = OrderedDict()    # (rank, seed) -> fresh state
        self.rank, self.swaps = 0, 0                    # the policy's LoRA rank; swaps so far
        self.futures: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.samplers: dict[str, tuple[str, str]] = {}    # sampling session -> (key, base model)
        self.snapshots: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.checkpoints: dict[str, Path] = {}            # tinker://.../weights/NAME -> dir
        self.slot = _EngineSlot()
        self.versions: dict[str, int] = {"base": 0}
        self.train = ThreadPoolExecutor(1, thread_name_prefix="molt-tinker-train")
        self.loop: asyncio.AbstractEventLoop | None = None
        self._cluster: contextlib.ExitStack | None = None
        self.policy: Any = None

    # -- lifecycle (the training thread) ------------------------------------------------------
    def _cfg(self, rank: int, seed: int) -> Config:
        from molt_core.run import cluster
        t = self.cfg.trainer
        cfg = replace(self.cfg, seed=seed, trainer=replace(
            t, mini_batches=1, epochs=1, lr_schedule="constant", warmup_steps=0,
            lora=replace(t.lora, rank=rank)))
        # `embedded` knows the fsdp2 backend by name only: decide as for it (no Ray on one box)
        local = cluster.embedded(cfg, True, torch.cuda.is_available())
        return replace(cfg, trainer=replace(cfg.trainer, backend="tinker"), ray=replace(
            cfg.ray, embedded="on" if local else cfg.ray.embedded))

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The cluster with the recipe's LoRA rank; the base weights kept for base sampling."""
        self.loop = loop
        self._restart(self.cfg.trainer.lora.rank or 32, self.cfg.seed)
        self.snapshots["base"] = self.policy.full_params()

    def _restart(self, rank: int, seed: int) -> None:
        """A new cluster whose LoRA has `rank` (the resident model's state kept first); its fresh
        adapters are the init of every model of that rank and seed."""
        from molt_core.run import cluster
        self._stash()
        if self._cluster is not None:
            asyncio.run_coroutine_threadsafe(self.slot.swap(None), self.loop).result()
            self._cluster.close()
        self._cluster = contextlib.ExitStack()
        self.policy, engines = self._cluster.enter_context(
            cluster.start(self._cfg(rank, seed), self.plugins))
        if not engines:
            raise RuntimeError("molt serve-tinker samples on the recipe's engine: set "
                               "engine.num_engines >= 1")
        asyncio.run_coroutine_threadsafe(self.slot.swap(engines[0]), self.loop).result()
        self.rank, self.inits[(rank, seed)] = rank, self.policy.get_state()
        while len(self.inits) > self.max_models:
            self.inits.popitem(last=False)

    def _stash(self) -> None:
        """The resident model's state out of the policy, into CPU memory."""
        if self.resident is not None:
            self.resident.state, self.resident = self.policy.get_state(), None

    def _use(self, m: Model) -> None:
        """Make `m` the resident model (the training thread): built on its first request, else
        the resident one's state out and m's in, the cluster restarted if the rank differs."""
        if m.freed:
            raise UserError(f"model '{m.id}' was freed (its session closed or expired)")
        if self.resident is m:
            return
        if m.run_dir is None:
            return self._build(m)
        t0 = time.perf_counter()
        self._stash()
        if self.rank != m.rank:
            self._restart(m.rank, m.seed)
        self.policy.set_state(m.state)
        m.state, self.resident = None, m
        self.swaps += 1
        m.swap_s += (dt := time.perf_counter() - t0)
        log.info("model_swap", model=m.id, swaps=self.swaps, seconds=round(dt, 4))

    def close(self) -> None:
        def stop() -> None:
            for m in self.models.values():
                self._drop(m)
            if self._cluster is not None:
                self._cluster.close()
        self.train.submit(stop).result()
        self.train.shutdown()

    # -- sessions and models ------------------------------------------------------------------
    def session(self, sid: str | None) -> Session:
        self._sweep()
        s = self.sessions.get(sid or "")
        if s is None:
            raise HTTPError(404, f"unknown session '{sid}'; create one (ServiceClient)")
        if s.finished:
            raise HTTPError(410, f"session '{sid}' has expired or finished (no heartbeat for "
                                 f"{self.session_timeout_s:.0f}s, or closed): start a new "
                                 "ServiceClient")
        s.last_seen = time.monotonic()
        return s

    def _sweep(self) -> None:
        """Sessions without a heartbeat for `session_timeout_s` expire; their models are freed."""
        now = time.monotonic()
        for s in self.sessions.values():
            if not s.finished and now - s.last_seen > self.session_timeout_s:
                log.info("session_expired", session=s.id)
                self.finish_session(s.id)

    def create_session(self) -> str:
        self._sweep()
        sid = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = Session(sid, time.monotonic())
        return sid

    def heartbeat(self, sid: str) -> None:
        self.session(sid)

    def finish_session(self, sid: str) -> None:
        """The session ends; its models are freed (their state dropped on the training thread,
        after the requests already queued there)."""
        if sid in self.sessions:
            self.sessions[sid].finished = True
        for m in self.models.values():
            if m.session == sid and not m.freed:
                m.freed = True
                self.train.submit(self._drop, m)
                log.info("model_freed", model=m.id)

    def _drop(self, m: Model) -> None:
        m.freed, m.state, m.kept = True, None, []
        if self.resident is m:
            self.resident = None
        if m.sink is not None:
            m.sink.close()
            m.sink = None

    def get_model(self, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None:
            raise HTTPError(404, f"unknown model '{model_id}' (create_lora_training_client)")
        if m.freed:
            raise HTTPError(404, f"model '{model_id}' was freed: its session closed or expired "
                                 "(create a new training client)")
        self.session(m.session)
        return m

    def base_name(self, name: str | None) -> str:
        if name not in self.names:
            raise HTTPError(400, f"unknown base model '{name}'; this server serves "
                                 f"{', '.join(repr(n) for n in self.names)} (the recipe's "
                                 "model.path or --model-name)")
        return self.names[0]

    def new_model(self, sid: str, seq: int, base: str | None, rank: int, seed: int | None,
                  targets: dict | None = None) -> Model:
        """A new model of session `sid`, built by its first request (`_use`)."""
        self.session(sid)
        name = self.base_name(base)
        if rank < 1:
            raise HTTPError(400, f"LoRA rank must be >= 1, got {rank}")
        live = [m.id for m in self.models.values() if not m.freed]
        if len(live) >= self.max_models:
            raise HTTPError(400, f"this server holds at most {self.max_models} live training "
                                 f"models and has {len(live)} ({', '.join(live)}): close a "
                                 "ServiceClient (its models are freed) or let its session "
                                 "expire, or restart the server with a larger --max-models")
        m = Model(f"{sid}:train:{seq}", sid, name, rank, self.cfg.seed if seed is None else seed)
        if m.id in self.models:
            raise HTTPError(400, f"model '{m.id}' exists (model_seq_id {seq} used twice)")
        self.models[m.id] = m
        return m

    def _build(self, m: Model) -> None:
        """The model's state (a fresh LoRA of its rank and seed), resident, and its run
        directory."""
        from molt_core.run.metrics import MetricsSink, make_run_dir
        from molt_core.trainer import _Log
        key = (m.rank, m.seed)
        self._stash()
        if key not in self.inits or self.rank != m.rank:
            self._restart(m.rank, m.seed)
        self.inits.move_to_end(key)
        self.policy.set_state(self.inits[key])
        self.resident = m
        cfg = self._cfg(m.rank, m.seed)
        m.run_dir = make_run_dir(cfg.out_dir, f"{cfg.name}-tinker", to_dict(cfg),
                                 self.plugins.info, m.seed, ["molt", "serve-tinker", m.id])
        (m.run_dir / "tinker.json").write_text(json.dumps(
            {"model_id": m.id, "base_model": m.base_model, "lora_rank": m.rank}))
        m.sink = MetricsSink(m.run_dir, cfg.trainer.steps, False, [
            self.plugins.get("metric_sink", k)(m.run_dir, cfg) for k in cfg.log.sinks])
        m.log = _Log(cfg, self.plugins, m.sink, lambda **_: {})
        log.info("model_created", model=m.id, rank=m.rank, run_dir=str(m.run_dir))

    # -- futures ------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], model: Model | None = None, seq: int | None = None,
               on_loop: bool = False) -> str:
        """A future id at once; `fn` runs on the training thread with `model` resident, in its
        seq order (or, `on_loop`, is a coroutine function run on the event loop)."""
        rid = uuid.uuid4().hex
        fut = self.futures[rid] = self.loop.create_future()
        while len(self.futures) > 10_000:
            self.futures.popitem(last=False)

        def job() -> Any:
            if model is not None:
                self._use(model)
            return fn()

        async def run() -> None:
            try:
                if on_loop:
                    out = await fn()
                elif model is None or seq is None:
                    out = await asyncio.wrap_future(self.train.submit(job))
                else:
                    out = await self._in_turn(model, seq, job)
                fut.set_result(out)
            except UserError as e:
                fut.set_result(("error", str(e), "user"))
            except Exception as e:          # the request fails; the service goes on
                log.error("request_failed", error=f"{type(e).__name__}: {e}",
                          traceback=traceback.format_exc())
                fut.set_result(("error", f"{type(e).__name__}: {e}", "server"))
        asyncio.ensure_future(run())
        return rid

    async def _in_turn(self, m: Model, seq: int, fn: Callable[[], Any]) -> Any:
        async with m.turn:
            try:   # a seq the server never got (a refused request) must not stall the model
                await asyncio.wait_for(m.turn.wait_for(lambda: m.next_seq >= seq), 60.0)
            except TimeoutError:
                log.warning("seq_gap", model=m.id, waiting_for=m.next_seq, got=seq)
            job = self.train.submit(fn)     # one thread: submission order is execution order
            m.next_seq = max(m.next_seq, seq) + 1
            m.turn.notify_all()
        return await asyncio.wrap_future(job)

    async def retrieve(self, rid: str) -> tuple:
        fut = self.futures.get(rid)
        if fut is None:
            raise HTTPError(404, f"unknown future '{rid}' (never issued, or evicted)")
        await asyncio.wait({fut}, timeout=self.poll_s)
        if not fut.done():
            return ("json", {"type": "try_again", "request_id": rid, "queue_state": "active"})
        out = fut.result()
        if out[0] == "error":
            return ("json", {"error": out[1], "category": out[2]})
        return out

    # -- training (the training thread) -------------------------------------------------------
    def _loss(self, name: str, config: dict) -> tuple[Any, dict, str]:
        config = dict(config)
        if molt := config.pop("molt_loss", None):           # any registered Molt loss by name
            try:
                fn = self.plugins.get("loss", str(molt))
            except Exception as e:
                raise UserError(str(e)) from None
            return fn, config, "advantages"
        if name not in LOSSES:
            raise UserError(f"loss_fn '{name}' is not served; valid: {', '.join(LOSSES)} (or "
                            "loss_fn_config={'molt_loss': NAME} for a Molt loss)")
        fn, args, weight, defaults = LOSSES[name]
        if unknown := sorted(set(config) - set(defaults)):
            raise UserError(f"loss_fn_config {unknown} not valid for {name}; it takes "
                            f"{sorted(defaults) or 'nothing'}")
        if isinstance(fn, str):
            try:
                fn = self.plugins.get("loss", fn)
            except Exception as e:
                raise UserError(f"{name} needs Molt's '{fn}' loss: {e}") from None
        return fn, args({**defaults, **config}), weight

    def forward_backward(self, m: Model, name: str, config: dict, datums: list[dict],
                         backward: bool) -> tuple[str, bytes]:
        fn, args, weight = self._loss(name, config)
        rows = wire.rows_of(datums, weight, weight != "weights", self.vocab)
        batch = wire.collate_rows(rows, self.tokenizer.pad_token_id or 0)
        lp = self.policy.logprobs(batch)
        mask = batch["loss_mask"]
        try:
            per_token, _ = fn(lp, batch.get("prox_logprobs", lp), batch["advantages"], mask,
                              **args)
        except TypeError as e:
            raise UserError(f"loss_fn_config does not suit the loss: {e}") from None
        per_token = (per_token * mask).detach()
        if backward:
            if m.kept and m.kept[0][1] != (fn, str(args)):
                raise UserError("one optimizer step takes one loss: call optim_step before a "
                                "forward_backward with another loss_fn or loss_fn_config")
            m.kept.append((rows, (fn, str(args)), args))
        n = [len(r.ids) for r in rows]
        out = [(lp[b, 1:k].numpy(), per_token[b, 1:k].numpy()) for b, k in enumerate(n)]
        return ("proto", wire.forward_output([o[0] for o in out], [o[1] for o in out],
                                             {"loss:sum": float(per_token.sum())}))

    def optim_step(self, m: Model, adam: dict) -> tuple[str, dict]:
        from molt_core.policy.objective import TrainStep
        if not m.kept:
            return ("json", {"metrics": {}})
        t0 = time.perf_counter()
        rows = [r for kept in m.kept for r in kept[0]]
        fn, args = m.kept[0][1][0], m.kept[0][2]
        m.kept = []
        self.policy.set_adam(lr=adam["learning_rate"], beta1=adam["beta1"], beta2=adam["beta2"],
                             eps=adam["eps"], weight_decay=adam["weight_decay"],
                             grad_clip_norm=adam["grad_clip_norm"])
        batch = wire.collate_rows(rows, self.tokenizer.pad_token_id or 0)
        metrics = self.policy.train(batch, TrainStep(fn, args, loss_agg="seq-mean-token-sum"))
        metrics = {k: v for k, v in metrics.items() if not k.startswith("mismatch/")}
        m.step += 1
        m.log(m.step, metrics | {"policy/version": m.step, "train/lr": adam["learning_rate"],
                                 "train/tokens": int(batch["loss_mask"].sum()),
                                 "time/step_s": time.perf_counter() - t0,
                                 "time/swap_s": m.swap_s, "tinker/swaps": self.swaps})
        m.swap_s = 0.0
        return ("json", {"metrics": {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                                     "learning_rate": adam["learning_rate"]}})

    def save_weights(self, m: Model, name: str, overwrite: bool) -> tuple[str, dict]:
        path = f"tinker://{m.id}/weights/{name}"
        if path in self.checkpoints and not overwrite:
            raise UserError(f"checkpoint '{path}' exists; pass overwrite=True or another name")
        out = m.run_dir / "tinker" / "weights" / name
        out.mkdir(parents=True, exist_ok=True)
        self.policy.save_checkpoint(str(out))
        (out / "tinker.json").write_text(json.dumps({"lora_rank": m.rank, "step": m.step,
                                                     "base_model": m.base_model}))
        self.checkpoints[path] = out
        return ("json", {"path": path, "type": "save_weights"})

    def checkpoint(self, path: str) -> tuple[Path, dict]:
        if path not in self.checkpoints:
            raise UserError(f"unknown checkpoint '{path}'; save_state / save_weights paths of "
                            "this server only")
        d = self.checkpoints[path]
        return d, json.loads((d / "tinker.json").read_text())

    def load_weights(self, m: Model, path: str, optimizer: bool) -> tuple[str, dict]:
        d, meta = self.checkpoint(path)
        if meta["lora_rank"] != m.rank:
            raise UserError(f"checkpoint '{path}' has LoRA rank {meta['lora_rank']}, the model "
                            f"{m.rank}")
        self.policy.load_checkpoint(str(d), False)
        if not optimizer:
            self.policy.reset_optimizer()
        m.kept, m.step = [], meta["step"]
        return ("json", {"path": path, "model_id": m.id, "type": "load_weights"})

    def save_for_sampler(self, m: Model, name: str | None) -> tuple[str, dict]:
        m.samplers += 1
        path = f"tinker://{m.id}/sampler_weights/{name or f'ephemeral-{m.samplers}'}"
        self.snapshots.pop(path, None)
        self.snapshots[path] = self.policy.full_params()
        self.versions[path] = len(self.versions)
        live = [k for k in self.snapshots if k != "base"]
        for old in live[:max(0, len(live) - self.keep_samplers)]:     # oldest first
            del self.snapshots[old]
        if name is not None:
            return ("json", {"path": path, "type": "save_weights_for_sampler"})
        return ("json", {"sampling_session_id": self.new_sampler(path, m.base_model),
                         "type": "save_weights_for_sampler"})

    # -- sampling (the event loop) ------------------------------------------------------------
    def new_sampler(self, path: str | None, base: str | None) -> str:
        key = path or "base"
        if key not in self.snapshots:
            raise HTTPError(404, f"unknown sampler weights '{path}': not saved by this server, "
                                 f"or evicted (it keeps the last {self.keep_samplers}; "
                                 "--keep-samplers)")
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        self.samplers[sid] = (key, base or self.names[0])
        return sid

    def _load(self, key: str) -> None:
        if key not in self.snapshots:
            raise UserError(f"sampler weights '{key}' were evicted (the server keeps the last "
                            f"{self.keep_samplers}; --keep-samplers)")
        weight_sync.send(iter(self.snapshots[key].items()), [self.slot.engine],
                         self.versions[key], 64 << 20, self.cfg.engine.timeout_s)

    async def sample(self, req: Any) -> tuple[str, bytes]:
        if req.sampling_session_id not in self.samplers:
            raise UserError(f"unknown sampling session '{req.sampling_session_id}'")
        key, _ = self.samplers[req.sampling_session_id]
        p, prompt = req.sampling_params, req.prompt.to_ints()
        if req.topk_prompt_logprobs or req.topk_sample_logprobs or req.prompt_alt_tokens_k or (
                req.target_prompt_logprobs is not None):
            raise UserError("top-k, target and alternative-token log-probs are not served by "
                            "molt serve-tinker (per-token and prompt log-probs are)")
        if not prompt:
            raise UserError("the prompt has no tokens")
        stop_ids = stop_strs = None
        if isinstance(p.stop, str):
            stop_strs = [p.stop]
        elif p.stop is not None and all(isinstance(s, str) for s in p.stop) and len(p.stop):
            stop_strs = list(p.stop)
        elif p.stop is not None:
            stop_ids = [int(s) for s in p.stop]
        greedy = p.temperature <= 0
        samplings = [{"temperature": 1.0 if greedy else float(p.temperature),
                      "top_k": 1 if greedy else max(int(p.top_k), 0), "top_p": float(p.top_p),
                      "min_p": 0.0, "repetition_penalty": 1.0,
                      "max_new_tokens": int(p.max_tokens or 256),
                      **({"stop_token_ids": stop_ids} if stop_ids is not None else {}),
                      **({"seed": int(p.seed) + i} if p.seed is not None else {})}
                     for i in range(req.num_samples)]
        async with self.slot.holding(key, self._load) as engine:
            outs = await engine.generate_batch.remote([prompt] * req.num_samples, samplings)
            scored = await engine.score.remote(prompt) if req.prompt_logprobs else None
        seqs = []
        for c in outs:
            if isinstance(c, Exception):
                raise UserError(str(c))
            tokens, lps, reason = list(c.token_ids), list(c.logprobs), c.finish_reason
            if stop_strs and (k := self._stop_at(tokens, stop_strs)) is not None:
                tokens, lps, reason = tokens[:k], lps[:k], "stop"
            seqs.append((tokens, lps, "stop" if reason == "stop" else "length"))
        prompt_lps = None
        if scored is not None:
            prompt_lps = [math.nan] + list(scored)
            if req.prompt_logprobs_last_n:
                cut = len(prompt) - req.prompt_logprobs_last_n
                prompt_lps = [math.nan] * cut + prompt_lps[cut:]
        return ("proto", wire.sample_output(seqs, prompt_lps))

    def _stop_at(self, tokens: list[int], stops: list[str]) -> int | None:
        """Tokens up to the first that completes a stop string (decoded text), or None."""
        def hit(k: int) -> bool:
            text = self.tokenizer.decode(tokens[:k])
            return any(s in text for s in stops)
        if not hit(len(tokens)):
            return None
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if hit(mid) else (mid + 1, hi)
        return lo

    def capabilities(self) -> dict:
        return {"supported_models": [{"model_name": self.names[0],
                                      "max_context_length": self.max_context,
                                      "trainable": True, "sampleable": True}]}

    def info(self, m: Model) -> dict:
        return {"type": "get_info", "model_id": m.id, "is_lora": True, "lora_rank": m.rank,
                "model_name": m.base_model,
                "model_data": {"arch": "molt", "model_name": m.base_model,
                               "tokenizer_id": str(Path(self.cfg.model.path).resolve())}}

