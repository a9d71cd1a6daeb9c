"""PPO with a learned critic and GAE (Schulman et al., 2017; GAE: Schulman et al., 2016): a
per-token estimator (`needs_values`; docs/algorithms.md, "PPO with GAE"); the policy loss is
`ppo_clip`, the trainer adds the critic's clipped value loss (`molt_core.algos.value_loss`)."""

from __future__ import annotations

from molt_core import hookimpl
from molt_core.algos import masked_whiten
from molt_core.lazy import torch

__all__ = ["gae", "ppo_advantages"]


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the masked positions t_1 < ... < t_n of each row (others are not time steps):
    delta_k = r_k + gamma V(s_k+1) - V(s_k) (V(s_n+1) = 0), A_k = delta_k + gamma lam A_k+1,
    R_k = A_k + V(s_k); (advantages, returns) [B, T], 0 off the mask."""
    m = mask.bool()
    adv = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        # an untrainable position is not a time step: carry the next step's value and advantage
        next_adv = torch.where(m[:, t], a, next_adv)
        next_value = torch.where(m[:, t], values[:, t], next_value)
        adv[:, t] = torch.where(m[:, t], a, torch.zeros_like(a))
    return adv, (adv + values) * m


def ppo_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   group_index: torch.Tensor, *, gamma: float = 1.0, lam: float = 0.95,
                   whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards, values, mask [B, T] (group_index [B] unused: the critic is the baseline)
    -> GAE advantages (batch-whitened when `whiten`) and returns, [B, T]."""
    adv, returns = gae(rewards, values, mask, gamma, lam)
    return (masked_whiten(adv, mask) if whiten else adv), returns


ppo_advantages.needs_values = True


@hookimpl
def molt_estimators() -> dict:
    return {"ppo": ppo_advantages}
