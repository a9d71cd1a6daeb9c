"""A re-rendered chat rollout (k segments, each its own training row) weighs as ONE rollout: the
same tokens as one segment or split into 3 give the same loss and gradients in every seq-mean
mode, for GSPO's sequence ratio and MIS/geo_mask's sequence weights. Real `training_batch`,
`objective`, losses and corrections on tensors (per-token log-probs stand in for the model's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from molt_core.advantage import training_batch
from molt_core.config import AlgorithmConfig
from molt_core.policy.logprobs import Forward
from molt_core.policy.objective import TrainStep, num_sequences, objective
from molt_core.policy.worker import PolicyWorker
from molt_core.trajectory import Completion, Trajectory
from molt_grpo import grpo_advantages, ppo_clip_loss
from molt_gspo import gspo_loss


def _rollouts(split: bool) -> list[Trajectory]:
    """Group 0: a 3-turn chat (3 segments when `split`), a short one-turn rollout and a
    two-turn one; group 1: two one-turn rollouts."""
    g = torch.Generator().manual_seed(0)
    out = []
    for group, turns, reward in ((0, [5, 3, 4], 1.0), (0, [2], 0.0), (0, [3, 6], 0.5),
                                 (1, [4], 1.0), (1, [7], 0.0)):
        t = Trajectory(group_id=group, rollout_id=len(out))
        for i, n in enumerate(turns):
            if i and split:
                t.segments.append(len(t))       # the chat template re-rendered the history
            t.add_prompt(torch.randint(1, 50, (3,), generator=g).tolist())
            lp = (-0.5 - torch.rand(n, generator=g)).tolist()
            t.add_completion(Completion(torch.randint(1, 50, (n,), generator=g).tolist(), lp,
                                        [0] * n))
        t.reward = reward
        out.append(t)
    return out


def _positions(trajs: list[Trajectory]) -> list[tuple[int, int, int]]:
    """(row, column, rollout token index) of every token in the batch's segment rows."""
    out, base, row = [], 0, 0
    for t in trajs:
        for s in t.split_segments():
            start = next(i for i in range(len(t) - len(s) + 1)
                         if t.token_ids[i:i + len(s)] == s.token_ids)
            out += [(row, j, base + start + j) for j in range(len(s))]
            row += 1
        base += len(t)
    return out


def _loss_and_grad(split: bool, spec: TrainStep) -> tuple[torch.Tensor, torch.Tensor]:
    trajs = _rollouts(split)
    alg = AlgorithmConfig()
    batch, _, _ = training_batch(trajs, grpo_advantages, alg, None, 1.0, 0)
    rows, cols, idx = map(torch.tensor, zip(*_positions(trajs)))
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(sum(map(len, trajs)), generator=g, requires_grad=True)
    prox_shift = 0.05 * torch.randn(theta.shape, generator=g)

    def layout(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(batch["loss_mask"].shape).index_put((rows, cols), values[idx])
        return out * batch["loss_mask"]
    behavior = batch["behavior_logprobs"]
    lp = behavior + layout(0.05 * theta)
    mb = {**batch, "prox_logprobs": behavior + layout(prox_shift)}
    fwd = Forward(lp, torch.zeros_like(lp))
    loss, _ = objective(spec, mb, fwd, int(batch["loss_mask"].sum()), num_sequences(batch))
    loss.backward()
    return loss.detach(), theta.grad


CASES = [TrainStep(ppo_clip_loss, {}, agg) for agg in
         ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")] + [
    TrainStep(gspo_loss, {"clip_low": 0.2, "clip_high": 0.2}, "seq-mean-token-mean"),
    TrainStep(gspo_loss, {}, "seq-mean-token-mean"),        # tiny clip: some rollouts clipped
    TrainStep(ppo_clip_loss, {}, "seq-mean-token-mean", correction="mis",
              correction_args={"cap": 1.1}),                # some rollouts' rho over the cap
    TrainStep(ppo_clip_loss, {}, "seq-mean-token-sum", correction="geo_mask",
              correction_args={"low": 0.98, "high": 1.02})]


@pytest.mark.parametrize("spec", CASES, ids=lambda s: f"{s.loss_fn.__name__}-{s.loss_agg}-"
                                                      f"{s.correction}-{s.correction_args}")
def test_a_split_rollout_weighs_as_its_one_segment_equivalent(spec):
    assert len(training_batch(_rollouts(True), grpo_advantages, AlgorithmConfig(), None, 1.0,
                              0)[0]["input_ids"]) == 8             # 5 rollouts, 8 rows
    one_loss, one_grad = _loss_and_grad(False, spec)
    split_loss, split_grad = _loss_and_grad(True, spec)
    assert one_grad.abs().sum() > 0
    assert torch.allclose(split_loss, one_loss, atol=1e-6)
    assert torch.allclose(split_grad, one_grad, atol=1e-6)


def test_micro_batches_keep_a_rollouts_segments_together():
    batch, _, _ = training_batch(_rollouts(True), grpo_advantages, AlgorithmConfig(), None, 1.0,
                                 0)                # rollout of each row: 0 0 0 1 2 2 3 4
    worker = SimpleNamespace(cfg={"micro_batch_size": 2}, device=torch.device("cpu"))
    got = [mb["rollout_index"].flatten().tolist()
           for mb in PolicyWorker._micro_batches(worker, batch)]
    assert got == [[0, 0, 0], [1], [2, 2], [3, 4]]     # as many micro-batches as 8 / 2
    worker.cfg["micro_batch_size"] = 1                   # a cut that would empty one: kept
    assert len(list(PolicyWorker._micro_batches(worker, batch))) == 8
    plain = {k: v for k, v in batch.items() if k != "rollout_index"}
    worker.cfg["micro_batch_size"] = 3
    assert [len(mb["input_ids"]) for mb in PolicyWorker._micro_batches(worker, plain)] == [3, 3, 2]


def test_mini_batches_and_rank_shards_keep_a_rollouts_segments_together():
    from molt_core.policy.handle import Policy, _cuts
    batch, _, _ = training_batch(_rollouts(True), grpo_advantages, AlgorithmConfig(), None, 1.0,
                                 0)                # rollout of each row: 0 0 0 1 2 2 3 4
    assert _cuts(batch, [2, 4, 6]) == [(0, 3), (3, 4), (4, 6), (6, 8)]   # mini_batches=4
    plain = {k: v for k, v in batch.items() if k != "rollout_index"}
    assert _cuts(plain, [3, 6]) == [(0, 3), (3, 6), (6, 8)]              # rows as they come
    policy = SimpleNamespace(workers=[None] * 3, replicas=1, in_driver=True)
    shards = Policy._split(policy, batch)            # 3 ranks: targets rows 3 and 6
    assert [s["rollout_index"].flatten().tolist() for s in shards] == [[0, 0, 0], [1, 2, 2],
                                                                        [3, 4, -1]]
    assert policy._sizes == [3, 3, 2] and not shards[2]["loss_mask"][2].any()   # padding
    assert Policy._unsplit(policy, [s["input_ids"] for s in shards]).equal(batch["input_ids"])
    policy.workers = [None] * 6                      # more shards than rollouts: padding only
    shards = Policy._split(policy, {k: v[:3] for k, v in batch.items()})
    assert policy._sizes == [3, 0, 0, 0, 0, 0] and {len(s["input_ids"]) for s in shards} == {3}


def test_tiny_model_step_is_the_same_whatever_the_micro_batch_size(ray_local, tiny_model_dir):
    """GSPO on the real trainer: micro-batches of 2 rows (the 3-segment rollout must not be cut)
    give the one-micro-batch step's loss and gradient norm."""
    from molt_core.config import TrainerConfig
    from molt_core.policy.handle import Policy
    batch, _, _ = training_batch(_rollouts(True), grpo_advantages, AlgorithmConfig(), None, 1.0,
                                 0)
    spec = TrainStep(gspo_loss, {"clip_low": 0.9, "clip_high": 9.0}, "seq-mean-token-mean")
    out = []
    for size in (64, 2):
        policy = Policy(str(tiny_model_dir), TrainerConfig(micro_batch_size=size), seed=0)
        try:
            if not out:     # behavior log-probs near the trainer's: ratios inside the clip
                noise = 0.3 * torch.randn(batch["loss_mask"].shape,
                                           generator=torch.Generator().manual_seed(2))
                batch["behavior_logprobs"] = (policy.logprobs(batch) + noise) * batch["loss_mask"]
            out.append(policy.train(batch, spec))
        finally:
            policy.shutdown()
    assert out[0]["grad_norm"] > 0
    for key in ("loss", "grad_norm"):     # a cut rollout: 1.4 % and 0.1 % apart
        assert abs(out[0][key] - out[1][key]) < 1e-5 * abs(out[0][key]), key
