"""RLOO advantages against the leave-one-out formula, by hand."""

from __future__ import annotations

import torch

from molt_rloo import rloo_advantages


def test_leave_one_out_baseline_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])             # group 1 has a single member
    # A_i = r_i - mean of the others: 1 - 0.25, 0 - 0.75, 0.5 - 0.5; alone -> 0; 3 - 5, 5 - 3
    expect = torch.tensor([0.75, -0.75, 0.0, 0.0, -2.0, 2.0])
    assert torch.allclose(rloo_advantages(rewards, groups), expect)


def test_group_ids_need_not_be_contiguous_or_sorted():
    rewards = torch.tensor([1.0, 4.0, 0.0, 2.0])
    groups = torch.tensor([7, 3, 7, 3])
    assert torch.allclose(rloo_advantages(rewards, groups), torch.tensor([1.0, 2.0, -1.0, -2.0]))
