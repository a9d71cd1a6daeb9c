"""Shared algorithm pieces in `molt_core.algos` against their formulas, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from molt_core.algos import clipped_surrogate, entropy_from_logits, kl_estimate, masked_whiten


def test_clipped_surrogate_asymmetric_by_hand():
    ratio = torch.tensor([0.5, 0.9, 1.25, 1.5, 0.5], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -2.0])
    loss, clipped = clipped_surrogate(ratio, adv, 0.2, 0.3)
    # max(-A r, -A clip(r, 0.8, 1.3))
    assert torch.allclose(loss, torch.tensor([-0.5, -0.9, -1.25, -1.3, 1.6]))
    assert clipped.tolist() == [False, False, False, True, True]
    loss.sum().backward()
    assert torch.allclose(ratio.grad, torch.tensor([-1.0, -1.0, -1.0, 0.0, 0.0]))


def test_kl_estimators_by_hand():
    lp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])
    log_rho = ref - lp                                     # log(pi_ref / pi)
    assert torch.allclose(kl_estimate(lp, ref, "k1"), -log_rho)
    assert torch.allclose(kl_estimate(lp, ref, "k2"), torch.tensor([0.5 * math.log(0.5) ** 2,
                                                                    0.5 * math.log(2.0) ** 2]))
    assert torch.allclose(kl_estimate(lp, ref, "k3"), torch.tensor([0.5 - 1 - math.log(0.5),
                                                                    2.0 - 1 - math.log(2.0)]))
    assert torch.all(kl_estimate(torch.randn(50), torch.randn(50), "k3") >= 0)
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        kl_estimate(lp, ref, "k4")


def test_k1_and_k3_are_unbiased_for_the_exact_kl():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    exact = float((p * (p / q).log()).sum())
    for kind in ("k1", "k3"):
        expectation = float((p * kl_estimate(p.log(), q.log(), kind)).sum())
        assert math.isclose(expectation, exact, rel_tol=1e-5), kind


def test_masked_whiten_ignores_masked_positions():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, -7.0, -7.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    vals = [1.0, 3.0, 5.0]
    mu, sd = 3.0, math.sqrt(sum((v - 3.0) ** 2 for v in vals) / 3)
    out = masked_whiten(x, mask, eps=0.0)
    expect = torch.tensor([[(1 - mu) / sd, 0.0, 0.0], [(5 - mu) / sd, 0.0, 0.0]])
    assert torch.allclose(out, expect)
    assert torch.allclose(masked_whiten(x, mask, shift_mean=False, eps=0.0)[0, :2],
                          torch.tensor([1 / sd, 3 / sd]))
    single = masked_whiten(torch.tensor([4.0, 9.0]), torch.tensor([True, False]))
    assert torch.equal(single, torch.zeros(2))             # one element: 0, not NaN


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    h = entropy_from_logits(logits)
    assert torch.allclose(h, torch.tensor([math.log(4), 0.0]), atol=1e-5)
    p = torch.softmax(torch.tensor([1.0, 2.0, 0.5]), -1)
    assert math.isclose(float(entropy_from_logits(torch.tensor([1.0, 2.0, 0.5]))),
                        float(-(p * p.log()).sum()), rel_tol=1e-6)
