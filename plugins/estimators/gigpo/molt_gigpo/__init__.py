"""GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent Training"): GRPO's
episode advantage plus omega times a step advantage, normalised within step groups: the turns,
across a group's rollouts, that start from the same state (`state_key`: the whole history before
the call, or the tokens since the last call)."""

from __future__ import annotations

import hashlib
from array import array
from typing import Literal

from molt_core import hookimpl
from molt_core.advantage import Rollouts
from molt_core.algos import group_stats, reward_to_go
from molt_core.lazy import torch

__all__ = ["gigpo", "gigpo_advantages", "step_keys"]


def _relative(x: torch.Tensor, groups: torch.Tensor, norm_std: bool, eps: float) -> torch.Tensor:
    mean, std, _ = group_stats(x, groups)
    return (x - mean) / (std + eps) if norm_std else x - mean


def gigpo(rewards: torch.Tensor, turn_rewards: torch.Tensor, keys: torch.Tensor,
          group_index: torch.Tensor, *, omega: float = 1.0, gamma: float = 0.95,
          norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A_ik = A^E_i + omega * A^S_ik: A^E over the group's rewards, A^S over the discounted returns
    R_ik = sum_{k' >= k} gamma^(k' - k) r_ik' of step group keys[i, k] (-1: no turn k, A = 0).
    Groups of one get 0. [R], [R, K], [R, K], [R] -> [R, K]"""
    ret = reward_to_go(turn_rewards, gamma)
    has = keys >= 0
    adv = torch.zeros_like(ret)
    adv[has] = (_relative(rewards, group_index, norm_std, eps)[:, None].expand_as(ret)[has]
                + omega * _relative(ret[has], keys[has], norm_std, eps))
    return adv


def step_keys(rollouts: Rollouts, group_index: torch.Tensor,
              state_key: Literal["history", "last_reply"] = "history") -> torch.Tensor:
    """[R, K] one id per (group, state) at each turn; -1 past a rollout's turns. The state:
    `history`, every token before the call (a hash of the prefix: same ids, same context);
    `last_reply`, the tokens from the end of the previous call (the start, for the first)."""
    turns, whole = [t.turns() for t in rollouts.trajectories], state_key == "history"
    keys, ids = torch.full((len(turns), max(max(map(len, turns)), 1)), -1), {}
    for i, (t, spans) in enumerate(zip(rollouts.trajectories, turns)):
        prefix, cut = hashlib.blake2b(), 0
        for k, (start, end) in enumerate(spans):
            part = array("q", t.token_ids[cut:start]).tobytes()
            prefix.update(part)
            keys[i, k] = ids.setdefault((int(group_index[i]), prefix.digest() if whole else part),
                                        len(ids))
            cut = start if whole else end
    return keys


def gigpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, rollouts: Rollouts,
                     omega: float = 1.0, gamma: float = 0.95, norm_std: bool = True,
                     eps: float = 1e-6, state_key: Literal["history", "last_reply"] = "history"
                     ) -> torch.Tensor:
    """`gigpo` on the rollouts' per-call rewards (`Rollouts.turn_rewards`) and step groups
    (`step_keys`: docs/algorithms.md, GiGPO, for which `state_key` suits an env). [R] -> [R, K]"""
    turn_rewards, _ = rollouts.turn_rewards(rewards)
    return gigpo(rewards, turn_rewards, step_keys(rollouts, group_index, state_key), group_index,
                 omega=omega, gamma=gamma, norm_std=norm_std, eps=eps)


gigpo_advantages.per_turn = True


@hookimpl
def molt_estimators() -> dict:
    return {"gigpo": gigpo_advantages}
