"""PPO-GAE against a hand-written reference of the paper's recursion, on hand-made tensors."""

from __future__ import annotations

import torch

from molt_core.algos import value_loss
from molt_ppo import gae, ppo_advantages


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain Python, one row at a time, over the row's trainable positions only."""
    adv = [[0.0] * len(r) for r in rewards]
    for i, row in enumerate(mask):
        steps = [t for t, m in enumerate(row) if m]
        running, next_v = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            running = delta + gamma * lam * running
            adv[i][t], next_v = running, values[i][t]
    ret = [[a + v if m else 0.0 for a, v, m in zip(ar, vr, mr)]
           for ar, vr, mr in zip(adv, values, mask)]
    return torch.tensor(adv), torch.tensor(ret)


# Row 0: prompt, 2 tokens, a tool token (masked, mid-episode), 2 tokens, padding; row 1: a single
# trainable token (a rollout alone in its group); row 2: no trainable token at all.
MASK = [[0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]
VALUES = [[9.0, 0.5, 0.25, 7.0, -0.5, 1.0, 3.0], [2.0, 2.0, 0.3, 5.0, 0, 0, 0], [1.0] * 7]
REWARDS = [[0, 0, 0.1, 0, 0, 1.0, 0], [0, 0, -1.0, 0, 0, 0, 0], [0] * 7]


def test_gae_matches_the_reference_with_masked_positions():
    r, v, m = torch.tensor(REWARDS), torch.tensor(VALUES), torch.tensor(MASK, dtype=torch.bool)
    for gamma, lam in [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.99, 0.0)]:
        adv, ret = gae(r, v, m, gamma, lam)
        want_adv, want_ret = reference_gae(REWARDS, VALUES, MASK, gamma, lam)
        assert torch.allclose(adv, want_adv, atol=1e-6), (gamma, lam)
        assert torch.allclose(ret, want_ret, atol=1e-6), (gamma, lam)
    # lam = 1, gamma = 1: A_t = (sum of rewards from t on) - V(s_t); masked values never count
    adv, ret = gae(r, v, m, 1.0, 1.0)
    assert torch.allclose(adv[0, [1, 2, 4, 5]], torch.tensor([1.1 - 0.5, 1.1 - 0.25, 1.5, 0.0]))
    assert torch.allclose(adv[1, 2], torch.tensor(-1.3)) and adv[2].abs().sum() == 0
    assert torch.allclose(ret[0, [1, 2, 4, 5]], torch.tensor([1.1, 1.1, 1.0, 1.0]))


def test_ppo_advantages_whiten_over_trainable_tokens_and_ignore_groups():
    r, v, m = torch.tensor(REWARDS), torch.tensor(VALUES), torch.tensor(MASK, dtype=torch.bool)
    raw, ret = ppo_advantages(r, v, m, torch.tensor([0, 1, 2]), lam=0.9, whiten=False)
    adv, ret2 = ppo_advantages(r, v, m, torch.tensor([0, 0, 0]), lam=0.9)
    assert torch.equal(ret, ret2)                 # groups of one or not: same result
    x = raw[m]
    assert torch.allclose(adv[m], (x - x.mean()) / (x.std(unbiased=False) + 1e-8), atol=1e-5)
    assert adv[~m].abs().sum() == 0
    assert ppo_advantages.needs_values is True


def test_clipped_value_loss_by_hand_and_its_gradient():
    old = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    ret = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    v = torch.tensor([[0.5, 0.1, 0.5, 1.0]], requires_grad=True)
    loss, clipped = value_loss(v, old, ret, clip=0.2)
    # t0: v moved 0.5 > clip: max((0.5-1)^2, (0.2-1)^2) = 0.64 (clipped branch, no grad)
    # t1: inside the range: (0.1-1)^2 = 0.81; t2: moved away, max(2.25, 1.44) = 2.25; t3: 0
    assert torch.allclose(loss, 0.5 * torch.tensor([[0.64, 0.81, 2.25, 0.0]]))
    assert clipped.tolist() == [[True, False, False, False]]
    loss.sum().backward()
    assert torch.allclose(v.grad, torch.tensor([[0.0, -0.9, 1.5, 0.0]]))
    plain, _ = value_loss(v.detach(), old, ret, clip=0.0)
    assert torch.allclose(plain, 0.5 * (v.detach() - ret) ** 2)
