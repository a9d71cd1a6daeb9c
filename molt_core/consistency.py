"""Invariant 3: the trainer reproduces the engine's log-probs on on-policy tokens (the
per-step check, its probe on fresh tokens, and the comparison the weight-sync canary uses)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from molt_core.config import Config
from molt_core.contracts import RolloutGenerator
from molt_core.trajectory import Trajectory, collate

__all__ = ["ForwardConsistencyError", "check_consistency", "consistency_tol", "logprob_gaps",
           "probe_consistency"]


class ForwardConsistencyError(RuntimeError):
    """Engine and trainer disagree on the model (invariant 3)."""


def probe_consistency(generator: RolloutGenerator, policy: Any, version: int, temperature: float
                      ) -> float:
    """Max |engine - trainer| log-prob over the trainable tokens of one fresh group that the
    engines sampled with `version` (the trainer's current weights)."""
    generator.counters["check/probe_groups"] += 1
    segs = [s for g in generator.generate(1) for t in g for s in t.split_segments()]
    return float(logprob_gaps(policy, segs, version, temperature).max())


def logprob_gaps(policy: Any, trajs: list[Trajectory], version: int, temperature: float
                 ) -> torch.Tensor:
    """[B] max |engine - trainer| log-prob over each row's trainable tokens `version` sampled
    (0 with none): the probe's and the weight-sync canary's comparison."""
    batch = collate(trajs, None)
    on = batch["loss_mask"] & (batch["versions"] == version)
    if not on.any():
        return torch.zeros(len(trajs))
    gap = (policy.logprobs(batch, temperature) - batch["behavior_logprobs"]).abs()
    return torch.where(on, gap, 0.0).amax(1)


def consistency_tol(cfg: Config) -> float:
    """`check.consistency_tol`, or by `model.dtype`: bf16 engines and trainers differ by up to
    0.2-0.5 on the same weights (SmolLM2, kernels' rounding), fp32 by < 1e-4; a changed tensor
    moves log-probs by whole nats."""
    return cfg.check.consistency_tol or (1e-3 if cfg.model.dtype == "float32" else 1.0)


def check_consistency(cfg: Config, step: int, metrics: dict[str, Any],
                      probe: Callable[[], float] | None = None) -> None:
    """Invariant 3: on on-policy tokens the trainer must reproduce the engine's log-probs. With
    none in the batch (async/partial: no token came from the weights just trained), `probe()`
    measures it on fresh on-policy tokens of the weights just pushed. At step 1 of 1..N (0 too),
    then every `check.consistency_every`."""
    if not (every := cfg.check.consistency_every) or step and (step - 1) % every:
        return
    if probe is not None and not metrics.get("mismatch/on_policy_fraction"):
        metrics["mismatch/max_abs"] = probe()
    gap, tol = metrics.get("mismatch/max_abs", 0.0), consistency_tol(cfg)
    if not gap <= tol:                              # NaN fails too
        raise ForwardConsistencyError(
            f"step {step}: trainer and engine log-probs differ by up to {gap:.3g} on on-policy "
            f"tokens (check.consistency_tol={tol}). Likely causes: a dtype "
            "difference between engine and trainer (model.dtype), sampling parameters the trainer "
            "does not reproduce (temperature, top_p/top_k, penalties), a different chat template "
            "or tokenizer, or a model config mismatch between the two loads.")
