"""GRPO advantages and PPO-clip against the formulas, computed by hand."""

from __future__ import annotations

import math

import torch

from molt_grpo import grpo_advantages, ppo_clip_loss


def test_group_normalised_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 7.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])            # group 2 has a single member
    adv = grpo_advantages(rewards, groups, eps=0.0)
    std0 = math.sqrt(((0.5) ** 2 + (0.5) ** 2 + 0) / 2)  # unbiased std of [1, 0, 0.5]
    expect = [0.5 / std0, -0.5 / std0, 0.0, 0.0, 0.0, 0.0]
    # group 1 has zero variance and group 2 one member: both give 0 (not NaN)
    adv = grpo_advantages(rewards, groups, eps=1e-6)
    assert torch.allclose(adv, torch.tensor(expect), atol=1e-5)
    assert torch.allclose(grpo_advantages(rewards, groups, norm_std=False),
                          torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0]))


def test_ppo_clip_by_hand_with_masked_positions():
    lp = torch.tensor([[0.0, math.log(1.5), math.log(0.5), 0.0]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[0.0, 1.0, 1.0, -1.0]])
    mask = torch.tensor([[False, True, True, False]])
    loss, m = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    # t=1: ratio 1.5, A=+1 -> max(-1.5, -1.3) = -1.3 (clipped); t=2: ratio 0.5 -> max(-0.5, -0.8) = -0.5
    assert torch.allclose(loss[0, 1:3], torch.tensor([-1.3, -0.5]))
    assert m["clip_fraction"][0, 1].item() == 1.0 and m["clip_fraction"][0, 2].item() == 0.0


def test_ppo_clip_gradient_stops_outside_the_trust_region():
    lp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, _ = ppo_clip_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
    loss.sum().backward()
    # clipped token: no gradient; inside: d(-A r)/d lp = -r
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -1.1]]), atol=1e-6)
