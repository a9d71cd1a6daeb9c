"""GRPO (Shao et al., 2024): group-relative advantages and the PPO-clip policy loss."""

from __future__ import annotations

from molt_core import hookimpl
from molt_core.algos import clipped_surrogate, group_stats
from molt_core.lazy import torch

__all__ = ["grpo_advantages", "ppo_clip_loss"]


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, norm_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g(r)) / (std_g(r) + eps); groups of one get 0. [R] -> [R]"""
    mean, std, _ = group_stats(rewards, group_index)
    adv = rewards - mean
    return adv / (std + eps) if norm_std else adv


def ppo_clip_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                  advantages: torch.Tensor, mask: torch.Tensor, *, clip_low: float = 0.2,
                  clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """l_t = max(-A r_t, -A clip(r_t, 1-eps_low, 1+eps_high)), r_t = pi(a_t)/pi_behavior(a_t).

    All tensors [B, T]; returns the per-token loss and per-token metrics."""
    ratio = torch.exp(logprobs - behavior_logprobs)
    loss, clipped = clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return loss, {"clip_fraction": clipped.float(), "ratio": ratio.detach()}


@hookimpl
def molt_estimators() -> dict:
    return {"grpo": grpo_advantages}


@hookimpl
def molt_losses() -> dict:
    return {"ppo_clip": ppo_clip_loss}
