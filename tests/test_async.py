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
from molt_core.rollout.generator import filter_stale, version_lag_metrics
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


def test_icepop_keeps_the_ratio_inside_the_band_and_zero_outside():
    lp, beh, mask = _lp()
    w, m = is_correction(lp, beh, mask, "icepop", low=0.5, high=2.0)
    # IcePop as written: M(k) = k if alpha <= k <= beta else 0, k = pi_train / pi_infer
    k = torch.exp(lp - beh)
    want = torch.where((k >= 0.5) & (k <= 2.0) & mask, k, 0.0)
    torch.testing.assert_close(w, want)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.0], [1.5, 0.8, 0.0]]))
    assert m["is_filtered_fraction"].tolist() == [[0, 1, 1], [0, 0, 0]]   # masked pad: not counted


def test_mis_weights_by_the_sequence_ratio_below_the_cap():
    lp, beh, mask = _lp()
    # Liu et al.: rho = prod_t pi_train / pi_infer over the sequence, weight rho * 1[rho <= C]
    rho = torch.exp(((lp - beh) * mask).sum(-1, keepdim=True))        # [0.75, 1.2]
    for cap in (2.0, 1.0, 0.5):
        w, _ = is_correction(lp, beh, mask, "mis", cap=cap)
        want = torch.where(rho <= cap, rho, 0.0).expand(2, 3) * mask
        torch.testing.assert_close(w, want)
    w, _ = is_correction(lp, beh, mask, "mis", cap=1.0)
    torch.testing.assert_close(w, torch.tensor([[0.75, 0.75, 0.75], [0.0, 0.0, 0.0]]))
    huge = is_correction(beh + 30.0 * mask, beh, mask, "mis")[0]       # exp would overflow
    assert huge.isfinite().all() and (huge == 0).all()


def test_geo_mask_masks_whole_sequences_by_geometric_mean():
    lp, beh, mask = _lp()
    # row 0: (1 * 3 * 0.25)^(1/3) = 0.909 -> kept; row 1: (1.5 * 0.8)^(1/2) = 1.095 -> kept
    w, _ = is_correction(lp, beh, mask, "geo_mask", low=0.95, high=2.0)
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    w, _ = is_correction(lp, beh, mask, "geo_mask", low=0.5, high=1.05)
    assert w.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_corrected_loss_clips_against_the_proximal_policy():
    """Decoupled PPO: the ratio is pi_theta / pi_prox (clipped), the IS weight pi_prox / pi_beh;
    the weight carries no gradient and tokens outside the trust region get none either."""
    prox, beh, mask = _lp()
    lp = (prox + torch.tensor([[0.0, 0.5, -0.5], [-0.5, 0.1, 0.0]])).requires_grad_(True)
    w, _ = is_correction(prox, beh, mask, "tis", cap=2.0)
    assert not w.requires_grad
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    per_token, m = ppo_clip_loss(lp, prox, adv, mask, clip_low=0.2, clip_high=0.2)
    (per_token * w * mask).sum().backward()
    ratio = torch.exp(lp.detach() - prox)
    # clipped: r > 1 + 0.2 where A > 0, r < 1 - 0.2 where A < 0
    clipped = torch.tensor([[False, True, False], [True, False, False]])
    assert torch.equal(m["clip_fraction"].bool() & mask, clipped)
    want = torch.where(clipped, 0.0, -adv * ratio * w) * mask          # d(-A r w)/d lp = -A r w
    torch.testing.assert_close(lp.grad, want)


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
    scheme = AsyncScheme(cfg, pool, weights=None, engines=[])
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
