"""Per-turn credit: each model call's reward-to-go minus a leave-one-out baseline over the group's
other rollouts at the same turn index, unbiased when rollouts end at different turns (RLOO's
baseline, Kool et al., 2019, per turn; the bias of the per-turn-index alternative: verl RFC #7244)."""

from __future__ import annotations

from molt_core import hookimpl
from molt_core.advantage import Rollouts
from molt_core.algos import group_stats, reward_to_go
from molt_core.lazy import torch

__all__ = ["reward_to_go", "turn_rloo", "turn_rloo_advantages"]


def turn_rloo(turn_rewards: torch.Tensor, num_turns: torch.Tensor, group_index: torch.Tensor, *,
              gamma: float = 1.0) -> torch.Tensor:
    """A_ik = G_ik - mean{G_jk : j != i in i's group, n_j > k}; G_ik where no such j; 0 for
    k >= n_i. The baseline is a function of the other rollouts alone. [R, K], [R], [R] -> [R, K]"""
    ret = reward_to_go(turn_rewards, gamma)
    K = ret.shape[1]
    has = torch.arange(K) < num_turns[:, None]
    mean, _, n = group_stats(ret[has], (group_index[:, None] * K + torch.arange(K))[has])
    n = n.to(ret.dtype)
    adv = torch.zeros_like(ret)
    adv[has] = torch.where(n > 1, n / (n - 1).clamp(min=1) * (ret[has] - mean), ret[has])
    return adv


def turn_rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, rollouts: Rollouts,
                         gamma: float = 1.0) -> torch.Tensor:
    """`turn_rloo` on the rollouts' per-call rewards (`Rollouts.turn_rewards`). [R] -> [R, K]"""
    turn_rewards, n = rollouts.turn_rewards(rewards)
    return turn_rloo(turn_rewards, n, group_index, gamma=gamma)


turn_rloo_advantages.per_turn = True


@hookimpl
def molt_estimators() -> dict:
    return {"turn_rloo": turn_rloo_advantages}
