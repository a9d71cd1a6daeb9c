"""DAPO: clip-higher loss, overlong shaping at the buffer edges, dynamic sampling invariants."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import molt_dapo
from molt_core.config import Config, ConfigError
from molt_core.trajectory import Completion, Trajectory
from molt_dapo import (DapoConfig, DynamicSampler, dapo_advantages, dapo_loss, overlong_penalty)


def _traj(reward: float, length: int = 1) -> Trajectory:
    t = Trajectory()
    t.add_prompt([1, 2])
    t.add_completion(Completion([3] * length, [-0.5] * length, [0] * length))
    t.reward = reward
    return t


def _group(*rewards: float, length: int = 1) -> list[Trajectory]:
    return [_traj(r, length) for r in rewards]


def test_advantages_are_group_normalised():
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0, 2.0])
    adv = dapo_advantages(rewards, torch.tensor([0, 0, 1, 2, 2]), eps=0.0)
    std = math.sqrt(0.5)                                   # unbiased std of [1, 0]
    # a group of one and a flat group give 0, not NaN, even with eps = 0
    assert torch.allclose(adv, torch.tensor([0.5 / std, -0.5 / std, 0.0, 0.0, 0.0]))


def test_clip_higher_by_hand_with_masked_positions():
    lp = torch.tensor([[math.log(1.25), math.log(1.5), math.log(0.7), 4.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, m = dapo_loss(lp, torch.zeros(1, 4), adv, mask)   # eps_low 0.2, eps_high 0.28
    # 1.25 is inside the higher bound (PPO's 1.2 would clip it); 1.5 -> 1.28; 0.7, A<0 -> 0.8
    assert torch.allclose(loss, torch.tensor([[-1.25, -1.28, 0.8, 0.0]]), atol=1e-6)
    assert m["clip_fraction"][0, :3].tolist() == [0.0, 1.0, 1.0]
    loss.sum().backward()
    # stop-gradient of the clip: only the unclipped token moves, d(-A r)/d lp = -A r
    assert torch.allclose(lp.grad, torch.tensor([[-1.25, 0.0, 0.0, 0.0]]), atol=1e-6)


@pytest.mark.parametrize("length, expect", [
    (0, 0.0), (12, 0.0),              # up to Lmax - Lcache = 12: no penalty
    (13, -0.25), (14, -0.5),          # inside the buffer: (12 - L) / 4
    (16, -1.0),                       # L = Lmax: the buffer's end
    (17, -1.0), (100, -1.0),          # beyond Lmax
])
def test_overlong_penalty_at_the_buffer_edges(length, expect):
    assert overlong_penalty(length, max_length=16, buffer=4) == expect


def test_overlong_shaping_adds_the_penalty_once():
    sampler = DynamicSampler(DapoConfig(overlong_buffer=4, overlong_penalty_factor=0.5), 16, False)
    groups = [[_traj(1.0, 12), _traj(1.0, 14), _traj(0.0, 16)]]
    out = sampler(groups, refill=lambda n: pytest.fail("no refill without dynamic sampling"))
    assert [t.reward for t in out[0]] == [1.0, 0.75, -0.5]
    sampler.shape(out)                                      # idempotent
    assert [t.reward for t in out[0]] == [1.0, 0.75, -0.5]
    assert sampler.stats["dapo/overlong_penalized"] == 2


def _refiller(pattern):
    """A stand-in for Generator.generate: yields groups from `pattern` (cycled), counting calls."""
    source = itertools.cycle(pattern)
    calls = []

    def refill(n):
        calls.append(n)
        return [_group(*next(source)) for _ in range(n)]
    return refill, calls


def test_dynamic_sampling_drops_flat_groups_and_keeps_the_batch_size():
    groups = [_group(1, 1, 1), _group(0, 1, 0), _group(0, 0, 0), _group(0.5, 0.5, 0.5)]
    refill, calls = _refiller([(0, 0, 0), (1, 0, 1), (2, 2, 2)])
    sampler = DynamicSampler(DapoConfig(), 16, True)
    out = sampler(groups, refill)
    assert len(out) == 4
    assert all(max(t.reward for t in g) > min(t.reward for t in g) for g in out)
    assert out[0] is groups[1]                              # kept groups keep their order
    assert calls and sampler.stats["dapo/refill_rounds"] == len(calls)
    assert sampler.stats["dapo/groups_dropped"] >= 3


def test_shaping_runs_before_the_variance_check():
    # equal raw rewards, different lengths: the overlong penalty creates the variance
    groups = [[_traj(1.0, 10), _traj(1.0, 14)]]
    sampler = DynamicSampler(DapoConfig(overlong_buffer=4), 16, True)
    out = sampler(groups, refill=lambda n: pytest.fail("group should be kept"))
    assert [t.reward for t in out[0]] == [1.0, 0.5]


def test_refill_rounds_are_bounded():
    refill, calls = _refiller([(1, 1)])
    sampler = DynamicSampler(DapoConfig(max_refill_rounds=3), 16, True)
    with pytest.raises(RuntimeError, match="max_refill_rounds"):
        sampler([_group(0, 0), _group(1, 1)], refill)
    assert len(calls) == 3
    refill, calls = _refiller([(1, 1)])
    out = sampler([_group(0, 1), _group(1, 1)], refill)     # some kept: a short batch, counted
    assert len(out) == 1 and sampler.stats["dapo/short_batch"] == 1 and len(calls) == 3


def _cfg(**dapo) -> Config:
    cfg = Config()
    cfg.algorithm.estimator = "dapo"
    cfg.sampling.max_new_tokens = 8
    cfg.plugins = {"dapo": DapoConfig(**dapo)}
    return cfg


def test_configure_validates_and_the_hooks_use_the_run_state():
    with pytest.raises(ConfigError, match="overlong_buffer"):
        molt_dapo.molt_configure(_cfg(overlong_buffer=8))
    cfg = _cfg()
    cfg.rollout.group_size = 1
    with pytest.raises(ConfigError, match="group_size"):
        molt_dapo.molt_configure(cfg)
    cfg = _cfg()
    cfg.algorithm.estimator = "grpo"                         # installed but not used: inactive
    molt_dapo.molt_configure(cfg)
    assert molt_dapo.molt_filter_batch([_group(1, 1)], 0, lambda n: []) is None
    molt_dapo.molt_configure(_cfg(overlong_buffer=2))
    refill, _ = _refiller([(0, 1)])
    out = molt_dapo.molt_filter_batch([_group(1, 1), _group(0, 1)], 0, refill)
    assert len(out) == 2 and all(len({t.reward for t in g}) > 1 for g in out)
    metrics = {}
    molt_dapo.molt_on_step_end(0, metrics)
    assert metrics["dapo/groups_dropped"] == 1.0 and metrics["dapo/refill_rounds"] == 1.0


def test_overlong_length_is_one_engine_response_not_the_turns_total():
    """Lmax (default sampling.max_new_tokens) caps each engine call: 3 turns x 6 tokens with a
    cap of 8 ran into no limit, while one 8-token turn among short ones did."""
    sampler = DynamicSampler(DapoConfig(overlong_buffer=2), 8, False)
    turns = [Trajectory(), Trajectory()]
    for t, lengths in zip(turns, ([6, 6, 6], [2, 8, 2])):
        t.add_prompt([1, 2])
        for n in lengths:
            t.add_completion(Completion([3] * n, [-0.5] * n, [0] * n,
                                        "length" if n == 8 else "stop"))
            t.add_prompt([4])                               # the env's reply
        t.reward = 1.0
    sampler.shape([turns])
    assert [t.reward for t in turns] == [1.0, 0.0]


def test_stale_tokens_masked_do_not_shorten_the_overlong_length():
    from collections import Counter

    from molt_core.rollout.generator import filter_stale
    t = Trajectory()
    t.add_prompt([1, 2])
    t.add_completion(Completion([3] * 8, [-0.5] * 8, [0] * 5 + [3] * 3, "length"))
    t.reward = 1.0
    groups = filter_stale([[t]], version=3, max_staleness=1, mode="mask", counters=Counter())
    assert groups[0][0].num_trainable == 3                  # 5 stale tokens masked
    DynamicSampler(DapoConfig(overlong_buffer=2), 8, False).shape(groups)
    assert t.reward == 0.0                                  # the 8 sampled tokens hit Lmax
