"""GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"): sequence-level ratio and clip,
in the paper's GSPO-token form (its derivation and why the clip range is tiny: docs/algorithms.md,
"GSPO"). Pair with group-normalised advantages (`grpo`)."""

from __future__ import annotations

from molt_core import hookimpl
from molt_core.algos import clipped_surrogate, rollout_sum
from molt_core.lazy import torch

__all__ = ["gspo_loss"]


def gspo_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, clip_low: float = 3e-4, clip_high: float = 4e-4,
              rollout_index: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GSPO loss [B, T]: the clipped objective of s_i = exp(mean_t (log pi - log pi_b))
    broadcast to its tokens; a sequence is a rollout, all rows of its `rollout_index` [B, 1]."""
    m = mask.to(logprobs.dtype)
    log_ratio = (logprobs - behavior_logprobs).detach() * m
    seq_log_ratio = (rollout_sum(log_ratio.sum(-1, keepdim=True), rollout_index)
                     / rollout_sum(m.sum(-1, keepdim=True), rollout_index).clamp(min=1))  # [B, 1]
    # value s_i at every token, gradient s_i * d log pi(y_t)
    ratio = torch.exp(seq_log_ratio.detach() + logprobs - logprobs.detach())            # [B, T]
    loss, clipped = clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return loss * m, {"clip_fraction": clipped.float(),
                      "seq_ratio": torch.exp(seq_log_ratio.detach()).expand_as(logprobs)}


@hookimpl
def molt_losses() -> dict:
    return {"gspo": gspo_loss}
