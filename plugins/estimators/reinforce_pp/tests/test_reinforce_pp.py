"""REINFORCE++ batch whitening against the formula, by hand."""

from __future__ import annotations

import statistics

import torch

from molt_reinforce_pp import reinforce_pp_advantages


def _whiten(xs):
    mu, sd = statistics.fmean(xs), statistics.pstdev(xs)
    return [(x - mu) / (sd + 1e-8) for x in xs]


def test_batch_whitened_rewards_ignore_groups():
    rewards = [1.0, 0.0, 0.5, 2.0, 3.0]
    groups = torch.tensor([0, 0, 0, 1, 2])                # groups of one are whitened like the rest
    adv = reinforce_pp_advantages(torch.tensor(rewards), groups)
    assert torch.allclose(adv, torch.tensor(_whiten(rewards)), atol=1e-6)
    assert abs(float(adv.mean())) < 1e-6 and abs(float(adv.std(unbiased=False)) - 1) < 1e-5


def test_group_baseline_then_batch_whitening():
    rewards = [1.0, 0.0, 0.5, 2.0, 3.0, 5.0]
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    centred = [0.5, -0.5, 0.0, 0.0, -1.0, 1.0]
    adv = reinforce_pp_advantages(torch.tensor(rewards), groups, group_baseline=True)
    assert torch.allclose(adv, torch.tensor(_whiten(centred)), atol=1e-6)


def test_constant_batch_gives_zero_not_nan():
    adv = reinforce_pp_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 1]))
    assert torch.equal(adv, torch.zeros(3))
    assert torch.equal(reinforce_pp_advantages(torch.tensor([4.0]), torch.tensor([0])),
                       torch.zeros(1))
