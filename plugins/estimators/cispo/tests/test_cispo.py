"""CISPO against the MiniMax-M1 formula, by hand: value, masks and the stop-gradient."""

from __future__ import annotations

import math

import torch

from molt_cispo import cispo_loss


def _case():
    # ratios 1.5 (above 1 + eps_high), 0.5 (below 1 - eps_low), 1.1 (inside), masked garbage
    lp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 3.0]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[2.0, -1.0, 1.0, 5.0]])
    mask = torch.tensor([[True, True, True, False]])
    return lp, old, adv, mask


def test_value_by_hand():
    lp, old, adv, mask = _case()
    loss, m = cispo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    w = [1.3, 0.8, 1.1]                                    # clip(r, 0.8, 1.3)
    expect = [-w[0] * 2.0 * math.log(1.5), w[1] * math.log(0.5), -w[2] * math.log(1.1), 0.0]
    assert torch.allclose(loss, torch.tensor([expect]), atol=1e-6)
    assert m["clip_fraction"][0, :3].tolist() == [1.0, 1.0, 0.0]


def test_default_has_no_lower_bound():
    lp = torch.tensor([[math.log(0.1)]])
    ones = torch.ones(1, 1)
    loss, m = cispo_loss(lp, torch.zeros(1, 1), ones, ones.bool())
    assert math.isclose(float(loss), -0.1 * math.log(0.1), rel_tol=1e-5)
    assert m["clip_fraction"].item() == 0.0


def test_gradient_flows_through_log_prob_only_even_when_clipped():
    lp, old, adv, mask = _case()
    lp.requires_grad_(True)
    loss, _ = cispo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    loss.sum().backward()
    # d/d lp of -sg(w) A lp = -w A: clipped tokens keep a (bounded) gradient, unlike PPO-clip
    assert torch.allclose(lp.grad, torch.tensor([[-1.3 * 2.0, 0.8, -1.1, 0.0]]), atol=1e-6)
