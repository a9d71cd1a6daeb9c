"""Helpers for plugin authors' tests: fake trajectories, and one step of the trainer's own path
(estimator -> per-token advantages -> loss -> aggregation -> backward) without a model or Ray."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch

from molt_core.advantage import opt_in, training_batch
from molt_core.algos import aggregate
from molt_core.config import AlgorithmConfig
from molt_core.trajectory import Completion, Trajectory

__all__ = ["fake_groups", "fake_trajectory", "run_step"]


def fake_trajectory(reward: float = 0.0, sampled: int = 4, *, group_id: int = 0,
                    rollout_id: int = 0, prompt: int = 3, logprob: float = -1.0,
                    truncated: bool = False, info: dict | None = None) -> Trajectory:
    """`prompt` masked tokens, then `sampled` trainable ones with behavior log-prob `logprob`."""
    t = Trajectory(group_id, rollout_id, reward=reward, info=dict(info or {}))
    t.add_prompt(list(range(1, prompt + 1)))
    t.add_completion(Completion(list(range(10, 10 + sampled)), [logprob] * sampled, [0] * sampled,
                                "length" if truncated else "stop"))
    return t


def fake_groups(rewards: list[list[float]], lengths: list[list[int]] | None = None,
                **kw: Any) -> list[list[Trajectory]]:
    """One group per inner list: `rewards[g][i]` (and `lengths[g][i]` sampled tokens)."""
    return [[fake_trajectory(r, lengths[g][i] if lengths else 4, group_id=g, rollout_id=i, **kw)
             for i, r in enumerate(rs)] for g, rs in enumerate(rewards)]


class _ZeroCritic:
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:   # a fresh value head
        return torch.zeros(batch["loss_mask"].shape)


def run_step(estimator: Callable, loss: Callable, groups: list[list[Trajectory]], *,
             estimator_args: dict | None = None, loss_args: dict | None = None,
             loss_agg: str = "token-mean", step: int = 0, logprob_shift: float = 0.0
             ) -> SimpleNamespace:
    """Advantages and one loss evaluation exactly as the trainer computes them, with the trainer's
    log-probs = behavior + `logprob_shift`. Returns `advantages` (the estimator's output),
    `batch`, `per_token`, `metrics`, `loss` (aggregated) and `grad` (d loss / d log-probs)."""
    alg = AlgorithmConfig(estimator_args=estimator_args or {}, loss_args=loss_args or {},
                          loss_agg=loss_agg)
    trajs = [t for g in groups for t in g]
    batch, adv, _ = training_batch(trajs, estimator, alg, _ZeroCritic(), 1.0, 0)
    mask, behavior = batch["loss_mask"], batch["behavior_logprobs"]
    lp = (behavior + logprob_shift).requires_grad_()
    kw = opt_in(loss, group_index=batch["group_index"], step=step, ref_logprobs=behavior)
    per_token, metrics = loss(lp, behavior, batch["advantages"], mask, **alg.loss_args, **kw)
    value = aggregate(per_token, mask, loss_agg, int(mask.sum()), int(mask.any(-1).sum()))
    value.backward()
    return SimpleNamespace(advantages=adv, batch=batch, per_token=per_token, metrics=metrics,
                           loss=value.detach(), grad=lp.grad)
