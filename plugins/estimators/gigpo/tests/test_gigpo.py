"""GiGPO's advantages against hand-computed values; step groups from real trajectories' tokens."""

from __future__ import annotations

import torch

from molt_core.advantage import Rollouts
from molt_core.trajectory import Completion, Trajectory
from molt_gigpo import gigpo, step_keys
from molt_grpo import grpo_advantages


def test_episode_plus_weighted_step_advantage_by_hand():
    # group 0: rollout 1 stops after one turn; rollouts 0 and 2 reach the same turn-1 observation
    turn_rewards = torch.tensor([[0.0, 1.0], [0.5, 0.0], [1.0, 0.0], [2.0, 0.0]])
    rewards = turn_rewards.sum(-1)
    keys = torch.tensor([[0, 1], [0, -1], [0, 1], [2, -1]])
    groups = torch.tensor([0, 0, 0, 1])
    adv = gigpo(rewards, turn_rewards, keys, groups, omega=2.0, gamma=0.5, norm_std=False)
    # A^E: rewards [1, 0.5, 1] - 5/6. Returns (gamma 0.5): [0.5, 1], [0.5], [1, 0]; step groups:
    # turn 0 {0.5, 0.5, 1} (mean 2/3), turn 1 {1, 0} (mean 1/2); group 1: alone, 0
    expect = torch.tensor([[1 / 6 + 2 * (-1 / 6), 1 / 6 + 2 * 0.5],
                           [-1 / 3 + 2 * (-1 / 6), 0.0],
                           [1 / 6 + 2 * (1 / 3), 1 / 6 + 2 * (-0.5)],
                           [0.0, 0.0]])
    assert torch.allclose(adv, expect, atol=1e-6)


def test_std_normalised_parts_and_omega_zero_is_grpo():
    turn_rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    rewards, groups = turn_rewards.sum(-1), torch.zeros(3, dtype=torch.long)
    keys = torch.tensor([[0, 1], [0, 1], [0, 2]])         # rollout 2 alone at its turn-1 state
    episode = grpo_advantages(rewards, groups)
    assert torch.allclose(gigpo(rewards, turn_rewards, keys, groups, omega=0.0),
                          episode[:, None].expand(3, 2))
    adv = gigpo(rewards, turn_rewards, keys, groups, gamma=1.0)
    ret0 = rewards                                       # turn-0 returns, one step group
    step0 = (ret0 - ret0.mean()) / (ret0.std() + 1e-6)
    step1 = torch.zeros(3)            # {0, 0} has equal returns; rollout 2 is alone
    assert torch.allclose(adv[:, 0], episode + step0, atol=1e-5)
    assert torch.allclose(adv[:, 1], episode + step1, atol=1e-5)


def _traj(group: int, replies: list[int], observations: list[list[int]]) -> Trajectory:
    t = Trajectory(group, 0)
    t.add_prompt([1, 2, 3])
    for k, tok in enumerate(replies):
        if k:
            t.add_prompt(observations[k - 1])
        t.add_completion(Completion([tok], [-1.0], [0]))
    return t


def test_step_groups_are_identical_observations_within_a_group():
    trajs = [_traj(0, [7, 8], [[4, 5]]), _traj(0, [9, 8], [[4, 5]]), _traj(0, [7, 8], [[4, 6]]),
             _traj(0, [7], []), _traj(1, [7, 8], [[4, 5]])]
    keys = step_keys(Rollouts.of(trajs), torch.tensor([0, 0, 0, 0, 1]))
    # turn 0: the group's shared prompt; turn 1: same tokens since the last call, same group
    assert keys[:4, 0].unique().numel() == 1 and keys[4, 0] != keys[0, 0]
    assert keys[0, 1] == keys[1, 1] and len({*keys[[0, 2, 4], 1].tolist()}) == 3
    assert keys[3, 1] == -1
