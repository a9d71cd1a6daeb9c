"""turn_rloo against hand-computed values, RLOO on single-turn groups, and a Monte-Carlo check that
its policy gradient is unbiased where rollouts stop at different turns (while the per-turn-index
baselines of verl RFC #7244 are not)."""

from __future__ import annotations

import torch

from molt_rloo import rloo_advantages
from molt_turn_rloo import reward_to_go, turn_rloo


def test_reward_to_go_and_leave_one_out_per_turn_by_hand():
    r = torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [2.0, 0.0, 0.0]])
    n, groups = torch.tensor([2, 1, 2, 1]), torch.tensor([0, 0, 0, 1])
    assert torch.allclose(reward_to_go(r[:1], 0.5), torch.tensor([[1.0, 1.0, 0.0]]))
    # returns G: [1.5, 1.0], [0.0], [0.5, 0.0]; turn 0 peers: all three, turn 1: rollouts 0 and 2
    expect = torch.tensor([[1.5 - (0.0 + 0.5) / 2, 1.0 - 0.0, 0.0],
                           [0.0 - (1.5 + 0.5) / 2, 0.0, 0.0],
                           [0.5 - (1.5 + 0.0) / 2, 0.0 - 1.0, 0.0],
                           [2.0, 0.0, 0.0]])            # no peer: the return itself (baseline 0)
    assert torch.allclose(turn_rloo(r, n, groups), expect)


def test_one_turn_each_is_rloo():
    rewards = torch.tensor([1.0, 0.0, 0.5, 3.0, 5.0])
    groups = torch.tensor([4, 4, 4, 9, 9])
    adv = turn_rloo(rewards[:, None], torch.ones(5, dtype=torch.long), groups)
    assert torch.allclose(adv[:, 0], rloo_advantages(rewards, groups))


# A 3-turn MDP whose policy decides when the episode ends: at turn k, action 0 stops with reward
# STOP[k], action 1 goes on with reward GO[k] (the last turn stops either way). Tabular softmax.
STOP, GO = [0.3, 1.0, 0.5], [0.1, 0.0, 0.2]


def _exact_gradient(theta: torch.Tensor) -> torch.Tensor:
    theta = theta.clone().requires_grad_()
    p = theta.softmax(-1)
    J = 0.0
    for n in (1, 2, 3):                                  # stop after n turns
        for last in ((0, 1) if n == 3 else (0,)):
            acts = [1] * (n - 1) + [last]
            prob = torch.stack([p[k, a] for k, a in enumerate(acts)]).prod()
            J = J + prob * sum(STOP[k] if a == 0 else GO[k] for k, a in enumerate(acts))
    J.backward()
    return theta.grad


def _sample(theta: torch.Tensor, groups: int, size: int, gen: torch.Generator):
    """Rollouts [R] (R = groups * size) of the MDP: per-turn rewards [R, 3], turns n [R], actions."""
    p = theta.softmax(-1)
    acts = (torch.rand(groups * size, 3, generator=gen) < p[:, 1]).long()    # [R, 3]
    stop = (acts == 0).long()
    stop[:, 2] = 1
    n = stop.argmax(-1) + 1
    live = torch.arange(3) < n[:, None]
    r = torch.where(acts == 0, torch.tensor(STOP), torch.tensor(GO)) * live
    return r, n, acts, live, torch.arange(groups).repeat_interleave(size)


def _gradient_samples(adv, acts, live, theta, size):
    """Per-group REINFORCE estimates (1/size) sum_i sum_k A_ik grad log pi(a_ik | s_k). [G, 3, 2]"""
    score = torch.nn.functional.one_hot(acts, 2).float() - theta.softmax(-1)   # [R, 3, 2]
    per = (adv * live)[..., None] * score
    return per.view(-1, size, 3, 2).sum(1) / size


def _naive_mt_grpo(r, n, group):
    """RFC #7244's biased construction: A_ik = sum_{k' >= k, k' < n_i} (r_ik' - mean_j r_jk'), the
    per-turn-index mean over the group's rollouts that reached k' (itself included)."""
    live = torch.arange(3) < n[:, None]
    G = int(group.max()) + 1
    s = torch.zeros(G, 3).index_add_(0, group, r * live)
    c = torch.zeros(G, 3).index_add_(0, group, live.float())
    centred = (r - (s / c.clamp(min=1))[group]) * live
    return centred.flip(-1).cumsum(-1).flip(-1) * live


def test_monte_carlo_gradient_is_unbiased_and_the_naive_per_turn_baseline_is_not():
    theta = torch.tensor([[0.2, -0.1], [0.0, 0.4], [-0.3, 0.1]])
    exact = _exact_gradient(theta)
    gen = torch.Generator().manual_seed(0)
    size, groups = 4, 200_000
    r, n, acts, live, group = _sample(theta, groups, size, gen)
    ours = _gradient_samples(turn_rloo(r, n, group), acts, live, theta, size)
    naive = _gradient_samples(_naive_mt_grpo(r, n, group), acts, live, theta, size)
    for est, unbiased in ((ours, True), (naive, False)):
        mean, se = est.mean(0), est.std(0) / groups ** 0.5
        z = ((mean - exact) / se).abs().max().item()
        assert (z < 4.0) if unbiased else (z > 10.0), (unbiased, z, mean, exact)
