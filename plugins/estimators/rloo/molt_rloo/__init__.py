"""RLOO (Kool et al., 2019; Ahmadian et al., 2024): REINFORCE with a leave-one-out baseline."""

from __future__ import annotations

from molt_core import hookimpl
from molt_core.algos import group_stats
from molt_core.lazy import torch

__all__ = ["rloo_advantages"]


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - 1/(n-1) sum_{j != i} r_j = n/(n-1) (r_i - mean_g(r)); a group of one gets 0.
    Each baseline excludes its rollout, so the policy gradient stays unbiased. [R] -> [R]"""
    mean, _, n = group_stats(rewards, group_index)
    n = n.to(rewards.dtype)
    scale = n / (n - 1).clamp(min=1)
    return torch.where(n > 1, scale * (rewards - mean), torch.zeros_like(rewards))


@hookimpl
def molt_estimators() -> dict:
    return {"rloo": rloo_advantages}
