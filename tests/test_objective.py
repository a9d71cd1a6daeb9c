"""The per-micro-batch objective as a pure function: tensors in, (loss, metrics) out, no FSDP, no
Ray, no process group. Each test recomputes by hand what `objective` must return."""

from __future__ import annotations

import math

import pytest
import torch

from molt_core.algos import aggregate, is_correction, kl_estimate
from molt_core.policy.logprobs import Forward
from molt_core.policy.objective import Tally, TrainStep, nanmax, needs_reference, objective
from molt_grpo import ppo_clip_loss

B, T = 3, 6


def micro_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows with trainable tails of different lengths; row 1 has no trainable token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 2:] = True
    mask[2, 4:] = True
    return {"input_ids": torch.randint(1, 50, (B, T), generator=g),
            "attention_mask": torch.ones(B, T, dtype=torch.bool), "loss_mask": mask,
            "advantages": torch.randn(B, 1, generator=g).expand(B, T) * mask,
            "behavior_logprobs": (-1.0 - torch.rand(B, T, generator=g)) * mask,
            "versions": torch.where(mask, 0, -1),
            "group_index": torch.tensor([[0], [0], [1]])}


def forward(mb: dict[str, torch.Tensor], seed: int = 1, **extra: torch.Tensor) -> Forward:
    g = torch.Generator().manual_seed(seed)
    mask = mb["loss_mask"]
    lp = (mb["behavior_logprobs"] + 0.3 * torch.randn(B, T, generator=g)) * mask
    return Forward(lp.requires_grad_(), torch.rand(B, T, generator=g) * mask, **extra)


def counts(mb: dict[str, torch.Tensor]) -> tuple[int, int]:
    """A step's global counts, here larger than the micro-batch's (other micro-batches/ranks)."""
    mask = mb["loss_mask"]
    return int(mask.sum()) + 5, int(mask.any(-1).sum()) + 2


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_no_correction_is_the_loss_on_pi_prox_aggregated(agg):
    """The ratio's denominator is the trainer's pi_prox (before the batch's first step), not the
    engine's log-probs 0.3 away: the gap neither clips nor weights (issue 41.4)."""
    mb = micro_batch()
    mb["prox_logprobs"] = (mb["behavior_logprobs"] + 0.05) * mb["loss_mask"]
    fwd = forward(mb)
    n_tok, n_seq = counts(mb)
    loss, metrics = objective(TrainStep(ppo_clip_loss, {"clip_low": 0.1}, agg), mb, fwd,
                              n_tok, n_seq)
    per_token, expect = ppo_clip_loss(fwd.logprobs, mb["prox_logprobs"], mb["advantages"],
                                      mb["loss_mask"], clip_low=0.1)
    assert torch.allclose(loss, aggregate(per_token, mb["loss_mask"], agg, n_tok, n_seq))
    assert metrics.keys() == {*expect, "entropy"}
    assert torch.equal(metrics["ratio"], expect["ratio"])
    loss.backward()                                  # the gradient reaches pi_theta
    assert fwd.logprobs.grad is not None and fwd.logprobs.grad.abs().sum() > 0


def test_an_on_policy_first_step_has_ratio_one_whatever_the_engine_gap():
    """One optimizer step, correction none, engine log-probs off by bf16-sized noise (up to 0.5,
    as SmolLM2 in bf16): TRL's ratio is exactly 1 there and nothing clips. Dividing by the
    engine's log-probs clipped ~1 % of such tokens."""
    mb = micro_batch()
    g = torch.Generator().manual_seed(3)
    trainer = mb["behavior_logprobs"].clone()
    mb["behavior_logprobs"] = trainer + (torch.rand(B, T, generator=g) - 0.5) * mb["loss_mask"]
    fwd = Forward(trainer.clone().requires_grad_(), torch.zeros(B, T))
    _, metrics = objective(TrainStep(ppo_clip_loss, {"clip_low": 0.2, "clip_high": 0.28}), mb,
                           fwd, *counts(mb))
    mask = mb["loss_mask"]
    assert torch.equal(metrics["ratio"][mask], torch.ones(int(mask.sum())))
    assert float(metrics["clip_fraction"][mask].sum()) == 0


def test_correction_uses_pi_prox_and_weights_each_token():
    mb = micro_batch()
    mb["prox_logprobs"] = (mb["behavior_logprobs"] + 0.4) * mb["loss_mask"]
    fwd = forward(mb)
    n_tok, n_seq = counts(mb)
    spec = TrainStep(ppo_clip_loss, correction="tis", correction_args={"cap": 1.2})
    loss, metrics = objective(spec, mb, fwd, n_tok, n_seq)
    per_token, _ = ppo_clip_loss(fwd.logprobs, mb["prox_logprobs"], mb["advantages"],
                                 mb["loss_mask"])
    weight, is_metrics = is_correction(mb["prox_logprobs"], mb["behavior_logprobs"],
                                       mb["loss_mask"], "tis", cap=1.2)
    assert (weight[mb["loss_mask"]] < math.exp(0.4)).all()          # the cap bit
    assert torch.allclose(loss, aggregate(per_token * weight, mb["loss_mask"], "token-mean",
                                          n_tok, n_seq))
    assert {"is_weight", "is_truncated_fraction", "is_filtered_fraction"} <= metrics.keys()
    assert torch.equal(metrics["is_weight"], is_metrics["is_weight"])


def test_one_step_per_batch_takes_pi_prox_from_this_forward():
    """Without `prox_logprobs` pi_prox is pi_theta detached: a ratio of 1, a weight of
    exp(pi_theta - pi_behavior)."""
    mb = micro_batch()
    fwd = forward(mb)
    spec = TrainStep(ppo_clip_loss, correction="icepop", correction_args={"low": 0.0,
                                                                            "high": 1e9})
    _, metrics = objective(spec, mb, fwd, *counts(mb))
    mask = mb["loss_mask"]
    assert torch.allclose(metrics["ratio"][mask], torch.ones(int(mask.sum())))
    w = (fwd.logprobs.detach() - mb["behavior_logprobs"]).exp()
    assert torch.allclose(metrics["is_weight"][mask], w[mask])


def test_kl_entropy_and_value_terms_follow_their_formulas():
    mb = micro_batch()
    mb["returns"], mb["old_values"] = torch.randn(B, T) * mb["loss_mask"], torch.zeros(B, T)
    values = torch.randn(B, T) * mb["loss_mask"]
    fwd = forward(mb, values=values)
    ref = (mb["behavior_logprobs"] - 0.2) * mb["loss_mask"]
    n_tok, n_seq = counts(mb)
    terms = {"kl_coef": 0.3, "kl_estimator": "k3", "entropy_coef": 0.05, "value_coef": 0.5,
             "value_clip": 0.0, "kl_in": "loss", "value_lr": 1e-3}
    spec = TrainStep(ppo_clip_loss, terms=terms)
    assert needs_reference(spec)
    loss, metrics = objective(spec, mb, fwd, n_tok, n_seq, ref_logprobs=ref)
    per_token, _ = ppo_clip_loss(fwd.logprobs, fwd.logprobs.detach(), mb["advantages"],
                                 mb["loss_mask"])
    kl = torch.exp(ref - fwd.logprobs) - 1 - (ref - fwd.logprobs)    # k3
    add = 0.3 * kl - 0.05 * fwd.entropy + 0.5 * 0.5 * (values - mb["returns"]) ** 2
    assert torch.allclose(loss, aggregate(per_token + add, mb["loss_mask"], "token-mean",
                                          n_tok, n_seq))
    assert torch.allclose(metrics["kl"], kl_estimate(fwd.logprobs, ref, "k3").detach())
    assert {"entropy", "kl", "value/loss", "value/clip_fraction"} <= metrics.keys()


def test_kl_in_the_reward_adds_no_loss_term_and_needs_no_reference():
    mb = micro_batch()
    spec = TrainStep(ppo_clip_loss, terms={"kl_coef": 0.3, "kl_in": "reward"})
    assert not needs_reference(spec) and not needs_reference(TrainStep(ppo_clip_loss))
    fwd = forward(mb)
    loss, metrics = objective(spec, mb, fwd, *counts(mb), ref_logprobs=fwd.logprobs.detach() - 1)
    assert "kl" not in metrics
    assert torch.equal(loss, objective(TrainStep(ppo_clip_loss), mb, fwd, *counts(mb))[0])


def test_a_loss_naming_its_inputs_gets_them():
    seen = {}

    def loss_fn(logprobs, behavior_logprobs, advantages, mask, *, ref_logprobs, group_index):
        seen.update(ref=ref_logprobs, group=group_index)
        return (logprobs - ref_logprobs) * mask, {}

    mb = micro_batch()
    spec = TrainStep(loss_fn)
    assert needs_reference(spec)
    ref = mb["behavior_logprobs"] - 0.5
    objective(spec, mb, forward(mb), *counts(mb), ref_logprobs=ref)
    assert seen["ref"] is ref and seen["group"] is mb["group_index"]


def test_moe_aux_loss_counts_by_the_micro_batch_share_of_sequences():
    mb = micro_batch()
    aux = torch.tensor(1.7, requires_grad=True)
    n_tok, n_seq = counts(mb)
    spec = TrainStep(ppo_clip_loss)
    plain, _ = objective(spec, mb, forward(mb), n_tok, n_seq, aux_coef=0.01)
    with_aux, _ = objective(spec, mb, forward(mb, aux_loss=aux), n_tok, n_seq, aux_coef=0.01)
    rows = int(mb["loss_mask"].any(-1).sum())                  # 2 of the step's n_seq = 4
    assert torch.allclose(with_aux - plain, torch.tensor(0.01 * 1.7 * rows / n_seq))
    off, _ = objective(spec, mb, forward(mb, aux_loss=aux), n_tok, n_seq, aux_coef=0.0)
    assert torch.equal(off, plain)


def test_tally_sums_counts_and_the_on_policy_maximum():
    mb = micro_batch()
    mb["versions"][0, 2] = 7                      # one token sampled by another version
    fwd = forward(mb)
    diff = (fwd.logprobs.detach() - mb["behavior_logprobs"]).abs()
    diff[0, 2] = 10.0                             # off-policy: not in the maximum
    fwd = Forward(mb["behavior_logprobs"] + diff * mb["loss_mask"], fwd.entropy)
    tally = Tally()
    metrics = {"ratio": torch.ones(B, T) * 2, "scalar": torch.tensor(3.0)}
    for _ in range(2):
        tally.add(mb, fwd, metrics, version=0)
    n = float(mb["loss_mask"].sum())
    on = mb["loss_mask"] & (mb["versions"] == 0)
    assert tally.max_abs == pytest.approx(float(diff[on].max()))
    assert tally.counts["ratio"] == tally.counts["scalar"] == 2 * n
    assert tally.sums["ratio"] == pytest.approx(2 * 2 * n)
    assert tally.sums["scalar"] == pytest.approx(2 * 3.0 * n)             # token-weighted
    assert tally.sums["mismatch/on_policy_fraction"] == 2 * float(on.sum())
    d = diff[mb["loss_mask"]]
    assert tally.sums["mismatch/kl"] == pytest.approx(2 * float((d.exp() - 1 - d).sum()))
    assert "moe/aux_loss" not in tally.sums


def test_tally_moe_routing_agreement_and_aux_loss():
    mb = micro_batch()
    rec = torch.tensor([0, 1]).expand(B, T, 2, 2).clone()
    rec[:, 0] = -1                                # not recorded: not counted
    mb["routed_experts"] = rec
    used = rec.clamp(min=0).flip(-1).clone()      # the same experts, another order
    used[0, 1, 1] = torch.tensor([2, 3])          # one (token, layer) routed elsewhere
    tally = Tally()
    tally.add(mb, Forward(mb["behavior_logprobs"], torch.zeros(B, T), None, used,
                          torch.tensor(0.5)), {}, None)
    has = B * (T - 1) * 2
    assert (tally.sums["moe/routing_agreement"], tally.counts["moe/routing_agreement"]) == (
        has - 1, has)
    rows = float(mb["loss_mask"].any(-1).sum())
    assert (tally.sums["moe/aux_loss"], tally.counts["moe/aux_loss"]) == (0.5 * rows, rows)


def test_nanmax_keeps_a_nan_wherever_it_comes():
    assert math.isnan(nanmax(float("nan"), 1.0)) and math.isnan(nanmax(1.0, float("nan")))
    assert nanmax(1.0, 2.0) == 2.0


def test_a_loss_returning_a_scalar_is_refused():
    """A reduced loss was aggregated as if per-token (issue 41.11): refused, naming the loss."""
    def mean_loss(logprobs, old_logprobs, advantages, mask):
        return -(advantages * logprobs)[mask].mean(), {}
    mb = micro_batch()
    with pytest.raises(ValueError, match=r"loss mean_loss returned shape \[\]; a molt_losses "
                                         r"loss returns per-token values \[3, 6\]"):
        objective(TrainStep(mean_loss), mb, forward(mb), *counts(mb))
