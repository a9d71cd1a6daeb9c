"""Trainer backend `fsdp2`, driver side: `Policy` starts `PolicyWorker` ranks (Ray actors; one
CPU rank reserving nothing: in the driver's process, `trainer.in_driver`), splits a collated batch
evenly across ranks, counts the step's global normalisers and merges the ranks' metrics."""

from __future__ import annotations

import functools
import math
import types
from dataclasses import asdict
from typing import Any

import ray
import torch
import torch.distributed as dist

from molt_core import weight_sync
from molt_core.config import TrainerConfig
from molt_core.plugins import PluginError
from molt_core.policy.objective import TrainStep, nanmax, num_sequences
from molt_core.policy.worker import PolicyWorker
from molt_core.run import actors, cluster

__all__ = ["Policy"]


def _wire(t: torch.Tensor) -> Any:   # numpy crosses Ray ~2x faster than a tensor; bf16 cannot
    return t if t.dtype == torch.bfloat16 else t.numpy()


def _pad_rows(batch: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Append n fully masked dummy rows (one attended pad token, so attention is never empty)."""
    if n == 0:
        return batch
    out = {}
    for k, v in batch.items():
        fill = torch.full((n, *v.shape[1:]), -1 if k in (
            "versions", "routed_experts", "rollout_index") else 0, dtype=v.dtype)
        if k == "attention_mask":
            fill[:, 0] = True
        out[k] = torch.cat([v, fill])
    return out


def _cuts(batch: dict[str, torch.Tensor], targets: list[int]) -> list[tuple[int, int]]:
    """Consecutive row ranges cut at the rollout start nearest each target row, so a rollout's
    rows (consecutive, `rollout_index`) stay together: its sequence-level quantities (seq-mean,
    GSPO's ratio, MIS) see all of it. Single-row rollouts: cut at the targets themselves."""
    B = batch["input_ids"].shape[0]
    ri = batch.get("rollout_index")
    starts = (list(range(B + 1)) if ri is None else
              [0, B] + (torch.nonzero(ri[1:, 0] != ri[:-1, 0]).flatten() + 1).tolist())
    edges = sorted({min(starts, key=lambda r: abs(r - t)) for t in targets} - {0} | {0, B})
    return list(zip(edges, edges[1:]))


class _InDriver:
    """A rank in the driver's process, called as its actor would be: `w.method.remote(...)` runs
    the call at once and returns its value (`Policy._get` and `push_weights` take it as is)."""

    def __init__(self, worker: PolicyWorker) -> None:
        self.worker = worker

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:                    # the engine's team runs next (`actors`)
                actors.release_threads()
        method = getattr(self.worker, name)
        return types.SimpleNamespace(remote=call)


class Policy:
    """Driver handle for `num_ranks` FSDP2 `PolicyWorker` actors; `actor_options`: each rank's Ray
    options (from `cluster.start`). Ranks of one tensor/context-parallel group get the same rows."""

    worker_cls: type = PolicyWorker

    def __init__(self, model_path: str, trainer_cfg: TrainerConfig, *, dtype: str = "float32",
                 seed: int = 0, num_threads: int = 1, actor_options: dict | None = None) -> None:
        self.cfg = trainer_cfg
        n = trainer_cfg.num_ranks
        self.replicas = trainer_cfg.tp_size * trainer_cfg.cp_size   # ranks per data shard
        self.nonfinite_steps = self._nonfinite_run = 0
        self._prox: torch.Tensor | None = None
        actor_options = actor_options or {"num_cpus": 0, "resources": {},
                                          "num_gpus": int(torch.cuda.is_available())}
        options, host, self._pg = cluster.rank_placement(n, actor_options, trainer_cfg.timeout_s)
        self._store = cluster.rendezvous(host, trainer_cfg.timeout_s)
        port = self._store.port
        args = dict(dtype=dtype, trainer=asdict(trainer_cfg), seed=seed, num_threads=num_threads)
        # one process group per process; a rank that reserves something is placed by Ray
        self.in_driver = (trainer_cfg.in_driver and n == 1 and not torch.cuda.is_available()
                          and not cluster.reserved(actor_options) and not dist.is_initialized())
        if self.in_driver:
            self._threads = torch.get_num_threads()     # the driver's, back at shutdown
            try:
                self.workers = [_InDriver(self.worker_cls(0, 1, host, port, model_path, **args))]
            except BaseException:
                self.shutdown()
                raise
            return
        actor = ray.remote(self.worker_cls)
        self.workers = [actor.options(**options[r]).remote(r, n, host, port, model_path, **args)
                        for r in range(n)]
        try:
            ray.get([w.ready.remote() for w in self.workers], timeout=trainer_cfg.timeout_s)
        except Exception:
            self.shutdown()
            raise

    def _split(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """One part per rank, a data shard's whole rollouts each; `_sizes`: its real rows."""
        # Equal rows per rank -> equal micro-batch counts -> FSDP collectives never hang.
        n = len(self.workers) // self.replicas
        B = batch["input_ids"].shape[0]
        cuts = _cuts(batch, [d * math.ceil(B / n) for d in range(1, n)])
        cuts += [(B, B)] * (n - len(cuts))      # fewer rollouts than shards: padding only
        self._sizes = [e - s for s, e in cuts]
        wire = (lambda t: t) if self.in_driver else _wire
        return [{k: wire(v) for k, v in _pad_rows({k: v[s:e] for k, v in batch.items()},
                                                  max(self._sizes) - (e - s)).items()}
                for s, e in cuts for _ in range(self.replicas)]

    def _unsplit(self, parts: list, sizes: list[int] | None = None) -> torch.Tensor:
        """The shards' results of a `_split` (default: the last; padding dropped) as one."""
        return torch.cat([torch.as_tensor(p[:k]) for p, k in zip(parts, sizes or self._sizes)])

    def _get(self, refs: list, what: str) -> list:
        if self.in_driver:
            return refs                 # the calls' values (`_InDriver`)
        try:
            return ray.get(refs, timeout=self.cfg.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"trainer {what} did not finish within {self.cfg.timeout_s}s "
                               "(trainer.timeout_s)") from None
        except ray.exceptions.RayTaskError as e:     # a plugin's loss: its one-line error
            if isinstance(e.cause, PluginError):
                raise PluginError(str(e.cause)) from e
            raise

    def train(self, batch: dict[str, torch.Tensor], spec: TrainStep) -> dict[str, float]:
        """`trainer.epochs` x `mini_batches` optimizer steps of `spec` on a `collate` batch [B, T]
        (an epoch: `mini_batches` consecutive parts, each loss normalised by its own global counts);
        plain-float metrics, token-weighted over all steps (`loss`, `grad_norm`, `train/lr`: the
        mean step's). Several steps: pi_prox first. A step with a non-finite loss or grad norm is
        skipped (`faults/nonfinite_steps`; `trainer.max_nonfinite_steps` in a row raise), as is one
        with a zero gradient (`train/no_signal_steps`)."""
        B = batch["input_ids"].shape[0]
        k = min(self.cfg.mini_batches, B)
        bounds = _cuts(batch, [j * (B // k) + min(j, B % k) for j in range(1, k)])
        self._prox = None           # trained_logprobs: the workers' own with one step
        if len(bounds) * self.cfg.epochs > 1:
            self._prox = self.logprobs(batch, spec.temperature)
            batch = {**batch, "prox_logprobs": self._prox}
        steps = []
        for _ in range(self.cfg.epochs):
            for s, e in bounds:
                part = {k: v[s:e] for k, v in batch.items()}
                steps.append(self._get([w.train_step.remote(
                    p, spec, int(part["loss_mask"].sum()), num_sequences(part))
                    for w, p in zip(self.workers, self._split(part))], "train_step")[::self.replicas])
                self._count_nonfinite(steps[-1][0]["nonfinite"])
        outs = [o for step in steps for o in step]
        self._trained = [o["logprobs"] for o in steps[-1]], self._sizes
        metrics = {"loss": sum(o["loss"] for o in outs) / len(steps),
                   "grad_norm": sum(step[0]["grad_norm"] for step in steps) / len(steps),
                   "train/lr": sum(step[0]["lr"] for step in steps) / len(steps),
                   "faults/nonfinite_steps": self.nonfinite_steps,
                   "train/no_signal_steps": sum(step[0]["no_signal"] for step in steps)}
        for k in outs[0]["sums"]:
            count = sum(o["counts"][k] for o in outs)
            metrics[k] = sum(o["sums"][k] for o in outs) / max(count, 1.0)
        for k in outs[0]["max"]:
            metrics[k] = functools.reduce(nanmax, (o["max"][k] for o in outs))
        for k in outs[0]["time"]:
            metrics[k] = sum(max(o["time"][k] for o in step) for step in steps)
        return metrics

    def _count_nonfinite(self, skipped: bool) -> None:
        self.nonfinite_steps += skipped
        self._nonfinite_run = self._nonfinite_run + 1 if skipped else 0
        if self._nonfinite_run >= self.cfg.max_nonfinite_steps:
            raise RuntimeError(
                f"{self._nonfinite_run} optimizer steps in a row had a non-finite loss or gradient "
                f"norm (trainer.max_nonfinite_steps={self.cfg.max_nonfinite_steps}); they were "
                "skipped, the weights are unchanged. Look for NaN/inf rewards, advantages or "
                "behavior log-probs, or lower trainer.lr (fp16 overflow: use model.dtype=bfloat16)")

    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                 with_routing: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T], 0 where not trainable; `with_routing` (MoE): also [B, T, layers, k] experts."""
        return self._per_rank("logprobs", batch, temperature, with_routing)

    def trained_logprobs(self) -> torch.Tensor:
        """[B, T] the last `train`'s pre-update log-probs: pi_prox (several steps) or its own."""
        return self._prox if self._prox is not None else self._unsplit(*self._trained)

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T] the critic's values at trainable positions (pre-update), 0 elsewhere."""
        return self._per_rank("values", batch)

    def ref_logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0
                     ) -> torch.Tensor:
        """[B, T] log-probs under the frozen initial weights at trainable positions."""
        return self._per_rank("ref_logprobs", batch, temperature)

    def _per_rank(self, method: str, batch: dict[str, torch.Tensor], *args: Any) -> Any:
        """The data shards' [b, T, ...] results of `method` as one [B, T, ...] (tuples: each)."""
        parts = self._get([getattr(w, method).remote(p, *args) for w, p in
                           zip(self.workers, self._split(batch))], method)[::self.replicas]
        if isinstance(parts[0], tuple):
            return tuple(None if col[0] is None else self._unsplit(col) for col in zip(*parts))
        return self._unsplit(parts)

    def full_params(self, adapter: bool = False, master: bool = False) -> dict[str, torch.Tensor]:
        """Gathered parameters by HF name (LoRA merged; `adapter`: adapters only, `master` fp32)."""
        out = self._get([w.full_params.remote(adapter, master) for w in self.workers],
                        "full_params")[0]
        # in the driver these would be the live parameters, which the next step changes
        return {k: t.clone() for k, t in out.items()} if self.in_driver else out

    def save_checkpoint(self, path: str) -> bool:
        """Every rank writes its shards under `path` (DCP); True when a critic was saved."""
        return self._get([w.save_checkpoint.remote(path) for w in self.workers], "checkpoint")[0]

    def load_checkpoint(self, path: str, critic: bool) -> None:
        self._get([w.load_checkpoint.remote(path, critic) for w in self.workers], "resume")

    def push_weights(self, engines: list, version: int) -> dict[str, Any]:
        args = (engines, version, int(self.cfg.weight_sync_bucket_mb * 2**20),     # embedded:
                self.cfg.weight_sync_timeout_s,        # the tensors themselves, the engine copies
                "ray" if actors.is_local(engines) else self.cfg.weight_sync_transport)
        if self.in_driver:          # the push is done: its stats (`_InDriver`)
            return self.workers[0].push_weights.remote(*args)
        return weight_sync.push(self.workers, *args)

    def shutdown(self) -> None:
        if self.in_driver:          # a later Policy may start in the driver too
            torch.set_num_threads(self._threads)
            if dist.is_initialized():
                dist.destroy_process_group()
        for w in self.workers if not self.in_driver else ():
            ray.kill(w)
        self.workers = []
        if self._pg is not None:
            ray.util.remove_placement_group(self._pg)
            self._pg = None
        self._store = None
