"""GSPO against the sequence-level formula of the paper, computed independently."""

from __future__ import annotations

import math

import torch

from molt_core.algos import aggregate
from molt_gspo import gspo_loss

EPS_LOW, EPS_HIGH = 0.1, 0.05


def _reference_objective(lp, old, adv, lengths):
    """-(1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean over the sequence of lp - old)."""
    terms = []
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        s = torch.exp(torch.as_tensor(sum(lp[i][t] - old[i][t] for t in range(n)) / n))
        a = adv[i]
        terms.append(torch.minimum(s * a, torch.clamp(s, 1 - EPS_LOW, 1 + EPS_HIGH) * a))
    return -sum(terms) / len(terms)


def _case():
    # three sequences: inside the clip range, clipped above (A > 0), and one with no trainable
    # token; positions after each length are masked and hold garbage log-probs
    lp = torch.tensor([[-1.0, -2.0, -0.5, 9.0],
                       [-0.2, -0.1, 7.0, 7.0],
                       [5.0, 5.0, 5.0, 5.0]])
    old = torch.tensor([[-1.01, -1.98, -0.52, 0.0],
                        [-0.5, -0.4, 0.0, 0.0],
                        [0.0, 0.0, 0.0, 0.0]])
    lengths = [3, 2, 0]
    mask = torch.tensor([[t < n for t in range(4)] for n in lengths])
    adv_seq = [1.5, 2.0, -1.0]
    adv = torch.tensor(adv_seq)[:, None].expand(3, 4)
    return lp, old, adv, adv_seq, mask, lengths


def test_value_matches_sequence_formula_with_masks():
    lp, old, adv, adv_seq, mask, lengths = _case()
    per_token, metrics = gspo_loss(lp, old, adv, mask, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    assert torch.all(per_token[~mask] == 0)
    loss = aggregate(per_token, mask, "seq-mean-token-mean", int(mask.sum()), 2)
    ref = _reference_objective(lp.tolist(), old.tolist(), adv_seq, lengths)
    assert math.isclose(float(loss), float(ref), rel_tol=1e-6)
    s1 = math.exp(((-0.2 + 0.5) + (-0.1 + 0.4)) / 2)      # 1.35 > 1 + eps_high: clipped
    assert torch.allclose(metrics["seq_ratio"][1], torch.full((4,), s1))
    assert metrics["clip_fraction"][1, :2].tolist() == [1.0, 1.0]
    assert metrics["clip_fraction"][0, :3].tolist() == [0.0, 0.0, 0.0]


def test_gradient_equals_sequence_level_gspo_gradient():
    lp, old, adv, adv_seq, mask, lengths = _case()
    lp_a = lp.clone().requires_grad_(True)
    per_token, _ = gspo_loss(lp_a, old, adv, mask, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    aggregate(per_token, mask, "seq-mean-token-mean", int(mask.sum()), 2).backward()

    lp_b = lp.clone().requires_grad_(True)
    _reference_objective([list(r) for r in lp_b.unbind(0)], old.tolist(), adv_seq,
                         lengths).backward()
    assert torch.allclose(lp_a.grad, lp_b.grad, atol=1e-6)
    # clipped sequence and masked positions get no gradient; inside the range s_i A_i / |y_i|
    assert torch.all(lp_a.grad[1] == 0) and torch.all(lp_a.grad[~mask] == 0)
    s0 = math.exp((0.01 - 0.02 + 0.02) / 3)
    assert torch.allclose(lp_a.grad[0, :3], torch.full((3,), -s0 * 1.5 / 3 / 2), atol=1e-6)
