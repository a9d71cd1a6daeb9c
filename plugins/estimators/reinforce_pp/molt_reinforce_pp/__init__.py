"""REINFORCE++ (Hu, 2025): no critic, no group baseline; advantages whitened over the batch's
rollouts, each counted once (why: docs/algorithms.md, "REINFORCE++"). Pair with `ppo_clip`."""

from __future__ import annotations

from molt_core import hookimpl
from molt_core.algos import group_stats, masked_whiten
from molt_core.lazy import torch

__all__ = ["reinforce_pp_advantages"]


def reinforce_pp_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *,
                            group_baseline: bool = False, eps: float = 1e-8) -> torch.Tensor:
    """A_i = (x_i - mean_batch(x)) / (std_batch(x) + eps), x = r (or r - mean_g(r)). [R] -> [R]"""
    x = rewards
    if group_baseline:
        mean, _, _ = group_stats(rewards, group_index)
        x = rewards - mean
    return masked_whiten(x, torch.ones_like(x, dtype=torch.bool), eps=eps)


@hookimpl
def molt_estimators() -> dict:
    return {"reinforce_pp": reinforce_pp_advantages}
