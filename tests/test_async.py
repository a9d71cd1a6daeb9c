"""Off-policy correction formulas, config checks and the staleness bound of the async scheme
(no Ray; the streaming pool and partial rollout are in test_partial.py)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from molt_core.algos import is_correction
from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.generator import filter_stale, version_lag_metrics
from molt_core.trajectory import Completion, Trajectory
from molt_grpo import ppo_clip_loss
from molt_rollout_async import AsyncScheme

# ---------------------------------------------------------------- correction formulas


def _lp():
    # log w per token (trainer - behavior); row 1 has a masked third token
    log_w = torch.tensor([[0.0, math.log(3.0), math.log(0.25)],
                          [math.log(1.5), math.log(0.8), 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    behavior = torch.full((2, 3), -1.0)
    return behavior + log_w, behavior, mask


def test_tis_truncates_the_weight():
    lp, beh, mask = _lp()
    w, m = is_correction(lp, beh, mask, "tis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.25], [1.5, 0.8, 0.0]]))
    assert m["is_truncated_fraction"].tolist() == [[0, 1, 0], [0, 0, 0]]
    assert m["is_filtered_fraction"].sum() == 0


def test_icepop_masks_tokens_outside_the_band():
    lp, beh, mask = _lp()
    w, m = is_correction(lp, beh, mask, "icepop", low=0.5, high=2.0)
    assert w.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert m["is_filtered_fraction"].tolist() == [[0, 1, 1], [0, 0, 0]]   # masked pad: not counted


def test_mis_masks_whole_sequences_by_geometric_mean():
    lp, beh, mask = _lp()
    # row 0: (1 * 3 * 0.25)^(1/3) = 0.909 -> kept; row 1: (1.5 * 0.8)^(1/2) = 1.095 -> kept
    w, _ = is_correction(lp, beh, mask, "mis", low=0.95, high=2.0)
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    w, _ = is_correction(lp, beh, mask, "mis", low=0.5, high=1.05)
    assert w.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_correction_weight_is_detached_and_scales_the_gradient():
    lp, beh, mask = _lp()
    lp = lp.clone().requires_grad_(True)
    w, _ = is_correction(lp, beh, mask, "tis", cap=2.0)
    assert not w.requires_grad
    adv = torch.ones(2, 3)
    per_token, _ = ppo_clip_loss(lp, lp.detach(), adv, mask)   # the proximal policy: ratio 1
    (per_token * w * mask).sum().backward()
    assert torch.allclose(lp.grad, -w)                          # d(-A r w)/d lp = -A w


def test_config_rejects_off_policy_schemes_without_correction(tiny_model_dir):
    base = [f"model.path={tiny_model_dir}", "agent.args.env=next_letter"]
    for scheme in ("async", "partial"):
        with pytest.raises(ConfigError, match="algorithm.correction"):
            load(None, base + [f"rollout.scheme={scheme}"])
        load(None, base + [f"rollout.scheme={scheme}", "algorithm.correction=icepop"])
    with pytest.raises(ConfigError, match="top_p"):
        load(None, base + ["algorithm.correction=tis", "sampling.top_p=0.9"])
    with pytest.raises(ConfigError, match="takes"):
        load(None, base + ["algorithm.correction=tis", "algorithm.correction_args={low: 1}"])


# ---------------------------------------------------------------- staleness


def traj(versions: list[int], group: int = 0) -> Trajectory:
    t = Trajectory(group_id=group)
    t.add_prompt([1, 2])
    t.add_completion(Completion([3] * len(versions), [-0.5] * len(versions), versions))
    return t


class OldPool:
    """A stand-in generator whose pool deliberately holds old groups first."""

    def __init__(self, versions: list[list[int]], fresh: int) -> None:
        self.queue = [[traj(v, i)] for i, v in enumerate(versions)]
        self.fresh = fresh
        self.counters: Counter[str] = Counter()

    def start_pool(self, k: int) -> None:
        self.k = k

    def take(self, n: int) -> list[list[Trajectory]]:
        while len(self.queue) < n:
            self.queue.append([traj([self.fresh] * 3, 99)])
        out, self.queue = self.queue[:n], self.queue[n:]
        return out


def scheme_cfg(tiny_model_dir, *extra):
    return load(None, [f"model.path={tiny_model_dir}", "agent.args.env=next_letter",
                       "rollout.scheme=async", "algorithm.correction=tis",
                       "rollout.groups_per_step=3", *extra])[0]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_max_staleness_never_trains_an_older_token(tiny_model_dir, k):
    cfg = scheme_cfg(tiny_model_dir, f"rollout.max_staleness={max(k, 1)}")
    cfg.rollout.max_staleness = k   # 0 is rejected at config time for async; the bound holds
    pool = OldPool([[0, 0], [1, 2], [3, 3], [2, 3], [5, 5], [4, 5], [0, 5]], fresh=5)
    scheme = AsyncScheme(cfg, pool, policy=None, engines=[])
    scheme.version = 5
    batch = scheme.next_batch(0)
    assert len(batch) == 3
    lags = [5 - v for g in batch for t in g for v, m in zip(t.versions, t.loss_mask) if m]
    assert max(lags) <= k
    assert pool.counters["rollout/dropped/stale_group"] >= 1
    more = scheme.refill(2)        # what a batch filter (DAPO) refills with: same bound
    assert len(more) == 2
    assert all(5 - v <= k for g in more for t in g for v, m in zip(t.versions, t.loss_mask) if m)
    if k == 0:      # exactly on-policy: every trained token was sampled by the trained weights
        assert set(lags) == {0}
        assert version_lag_metrics([t for g in batch for t in g], 5)["rollout/version_lag/0"] == 1


def test_stale_tokens_masked_not_dropped(tiny_model_dir):
    counters: Counter[str] = Counter()
    g = [traj([3, 4, 5]), traj([5, 5])]
    out = filter_stale([g], 5, 1, "mask", counters)
    assert out == [g]
    assert [v for v, m in zip(g[0].versions, g[0].loss_mask) if m] == [4, 5]
    assert counters["rollout/masked/stale_tokens"] == 1
    m = version_lag_metrics(g, 5)
    assert m["rollout/version_lag_max"] == 1 and m["rollout/version_lag/1"] == pytest.approx(0.25)
    assert m["rollout/multi_version"] == 0.5      # [4, 5] spans two versions, [5, 5] one
