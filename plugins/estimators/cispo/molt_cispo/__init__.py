"""CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, never drop a token's gradient.

J = sum_{i,t} sg(clip(r_{i,t}, 1 - eps_low, 1 + eps_high)) A_{i,t} log pi(y_{i,t}) / sum_i |y_i|
with r = pi / pi_behavior. Unlike PPO-clip, a token whose ratio left the trust region still
contributes its REINFORCE gradient (scaled by the clipped weight); only the weight is bounded.
The paper sets no lower bound (large eps_low: the default 1.0 clips at 0, which a ratio never
goes below) and tunes eps_high. The 1/sum|y_i| normaliser is `algorithm.loss_agg: token-mean`.
Pair with group-normalised advantages (`grpo`).
"""

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
