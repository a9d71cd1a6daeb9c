"""CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, never drop a token's gradient
(docs/algorithms.md, "CISPO"). Pair with group-normalised advantages (`grpo`)."""

from __future__ import annotations

from molt_core import hookimpl
from molt_core.lazy import torch

__all__ = ["cispo_loss"]


def cispo_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, *, clip_low: float = 1.0, clip_high: float = 0.28
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t). All [B, T]."""
    ratio = torch.exp(logprobs - behavior_logprobs).detach()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * advantages * logprobs
    return loss * mask.to(loss.dtype), {"clip_fraction": (weight != ratio).float(), "ratio": ratio}


@hookimpl
def molt_losses() -> dict:
    return {"cispo": cispo_loss}
