"""The shared loss terms (`algorithm.terms`): KL to the frozen initial weights, entropy bonus and
the critic, against hand computations on hand-made tensors and on the unsharded tiny model;
1 rank and 2 ranks (with empty micro-batches) must agree."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest
import ray
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from molt_core.advantage import training_batch
from molt_core.algos import entropy_from_logits, kl_estimate, loss_terms
from molt_core.config import AlgorithmConfig, LossTermsConfig, TrainerConfig
from molt_core.plugins import PluginError
from molt_core.policy.handle import Policy
from molt_core.policy.objective import TrainStep
from molt_core.trajectory import Completion, Trajectory

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ship `zero_loss` by value


def zero_loss(logprobs, behavior_logprobs, advantages, mask):
    """No policy loss: the step's gradient is the terms' alone."""
    return 0.0 * logprobs, {}


def test_loss_terms_by_hand():
    lp = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]], requires_grad=True)
    ref = torch.tensor([[0.0, math.log(0.25), math.log(0.25)]])
    ent = torch.tensor([[0.0, 1.0, 2.0]], requires_grad=True)
    v, old, ret = torch.tensor([[0.0, 0.5, 1.0]]), torch.zeros(1, 3), torch.ones(1, 3)
    add, m = loss_terms(lp, ent, ref_logprobs=ref, values=v, old_values=old, returns=ret,
                        kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01, value_coef=0.5,
                        value_clip=0.0)
    # t1: 0.1 * k1 (log 0.5 - log 0.25 = log 2) - 0.01 * 1 + 0.5 * 0.5 * (0.5 - 1)^2
    want = [0.5 * 0.5 * 1.0, 0.1 * math.log(2) - 0.01 + 0.0625, -0.02]
    assert torch.allclose(add, torch.tensor([want]), atol=1e-6)
    assert set(m) == {"entropy", "kl", "value/loss", "value/clip_fraction"}
    add.sum().backward()
    assert torch.allclose(lp.grad, torch.full((1, 3), 0.1))           # d k1 / d lp = 1
    assert torch.allclose(ent.grad, torch.full((1, 3), -0.01))
    # no reference, no critic: only the entropy bonus, and no kl / value metrics
    add, m = loss_terms(lp, ent, entropy_coef=0.5)
    assert torch.allclose(add, -0.5 * ent) and set(m) == {"entropy"}


def make_batch(B: int = 5, T: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows; row 2 has no trainable token; returns for the critic."""
    g = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.randint(1, 500, (B, T), generator=g),
             "attention_mask": torch.zeros(B, T, dtype=torch.bool),
             "loss_mask": torch.zeros(B, T, dtype=torch.bool),
             "behavior_logprobs": torch.zeros(B, T), "advantages": torch.zeros(B, T),
             "versions": torch.zeros(B, T, dtype=torch.long)}
    for i in range(B):
        n = T - 2 * i
        batch["attention_mask"][i, :n] = True
        if i != 2:
            batch["loss_mask"][i, 3:n] = True
    batch["returns"] = torch.randn(B, T, generator=g) * batch["loss_mask"]
    batch["old_values"] = torch.zeros(B, T)
    return batch


def full_forward(model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unsharded reference: log-probs, entropies and final hidden states of the state before
    each trainable token, flattened over the trainable tokens [N], [N], [N, H]."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                output_hidden_states=True)
    rows, cols = batch["loss_mask"][:, 1:].nonzero(as_tuple=True)
    logits = out.logits[rows, cols].float()
    lp = logits.log_softmax(-1).gather(-1, batch["input_ids"][rows, cols + 1, None]).squeeze(-1)
    return lp, entropy_from_logits(logits), out.hidden_states[-1][rows, cols]


def grad_norm(model) -> float:
    return float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()
                                if p.grad is not None)))


@pytest.fixture(scope="module")
def policies(ray_local, tiny_model_dir):
    path = str(tiny_model_dir)
    made = {"one": Policy(path, TrainerConfig(lr=1e-3, timeout_s=60.0, grad_clip=1e6)),
            "two": Policy(path, TrainerConfig(lr=1e-3, timeout_s=60.0, grad_clip=1e6,
                                              num_ranks=2, micro_batch_size=1,
                                              logprob_chunk=3))}
    yield path, made
    for p in made.values():
        p.shutdown()


@pytest.fixture(scope="module")
def steps(policies):
    """Per policy: critic step, entropy step, KL step (zero policy loss throughout)."""
    path, made = policies
    batch = make_batch()
    out = {}
    for name, p in made.items():
        r = {"params0": p.full_params(), "values0": p.values(batch)}
        r["critic"] = p.train(batch, TrainStep(zero_loss, terms={"value_coef": 1.0, "value_clip": 0.0,
                                                       "value_lr": 0.01}))
        r["values1"], r["params1"] = p.values(batch), p.full_params()
        plain = {k: v for k, v in batch.items() if k not in ("returns", "old_values")}
        r["entropy"] = p.train(plain, TrainStep(zero_loss, terms={"entropy_coef": 0.1}))
        r["params2"] = p.full_params()
        r["kl"] = p.train(plain, TrainStep(zero_loss, terms={"kl_coef": 0.5, "kl_estimator": "k2"}))
        out[name] = r
    return path, batch, out


def test_critic_learns_from_returns_and_never_moves_the_policy(steps):
    path, batch, out = steps
    mask = batch["loss_mask"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        _, _, h = full_forward(model, batch)
    # zero-initialised head; loss 1/2 (v - R)^2 token-mean -> dL/dW = -sum_t R_t h_t / N, and
    # Adam's first step moves every parameter by lr against the sign of its gradient.
    R = batch["returns"][mask]
    gw, gb = -(R[:, None] * h).sum(0) / len(R), -R.sum() / len(R)
    want = h @ (-0.01 * torch.sign(gw)) - 0.01 * torch.sign(gb)
    for name, r in out.items():
        assert (r["values0"] == 0).all(), name
        assert "value/loss" in r["critic"] and "kl" not in r["critic"]
        assert r["critic"]["value/loss"] == pytest.approx(float((0.5 * R ** 2).mean()), rel=1e-5)
        torch.testing.assert_close(r["values1"][mask], want, atol=1e-4, rtol=1e-4)
        assert (r["values1"][~mask] == 0).all()
        assert all(torch.equal(r["params0"][k], r["params1"][k]) for k in r["params0"]), name


def test_entropy_bonus_matches_the_full_vocab_gradient(steps):
    path, batch, out = steps
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _, ent, _ = full_forward(model, batch)
    (-0.1 * ent.mean()).backward()                       # token-mean of -coef * H
    for name, r in out.items():
        assert r["entropy"]["entropy"] == pytest.approx(float(ent.detach().mean()), rel=1e-5), name
        assert r["entropy"]["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4), name
        assert "kl" not in r["entropy"]


def test_kl_to_the_initial_weights_is_reported_and_in_the_gradient(steps):
    path, batch, out = steps
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref, _, _ = full_forward(ref_model, batch)
    for name, r in out.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.load_state_dict(r["params2"], strict=False)       # the policy after 2 steps
        lp, _, _ = full_forward(model, batch)
        kl = kl_estimate(lp, ref, "k2")
        (0.5 * kl.mean()).backward()
        mean = kl.detach().mean().item()
        assert mean > 1e-6                                     # the policy has moved
        assert r["kl"]["kl"] == pytest.approx(mean, rel=1e-4), name
        assert r["kl"]["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4), name
    # each matches its reference to ~1e-7; Adam's first steps (~lr * sign g) move the two apart
    assert out["one"]["kl"]["kl"] == pytest.approx(out["two"]["kl"]["kl"], rel=1e-4)


def _traj(prompt: list[int], completion: list[int], logprobs: list[float], reward: float,
          group: int) -> Trajectory:
    t = Trajectory(group_id=group, reward=reward)
    t.add_prompt(prompt)
    t.add_completion(Completion(completion, logprobs, [0] * len(completion)))
    return t


def test_kl_as_reward_penalty_and_token_level_estimators(policies):
    path, made = policies
    policy = made["one"]                      # its weights moved in `steps`; the reference did not
    trajs = [_traj([5, 6, 7], [8, 9], [-1.0, -2.0], 1.0, 0),
             _traj([5, 6], [10, 11, 12], [-0.5, -0.1, -3.0], 0.0, 0),
             _traj([7], [13], [-2.5], 0.5, 1)]
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen = {}

    def per_rollout(rewards, group_index):
        seen["rewards"] = rewards
        return rewards

    def per_token(rewards, values, mask, group_index, *, scale=1.0):
        seen.update(token_rewards=rewards, values=values, mask=mask, groups=group_index)
        return scale * rewards, rewards + values
    per_token.needs_values = True

    alg = AlgorithmConfig(terms=LossTermsConfig(kl_coef=0.2, kl_estimator="k1", kl_in="reward"))
    batch, adv, metrics = training_batch(trajs, per_rollout, alg, policy, 1.0, 0)
    mask = batch["loss_mask"]
    with torch.no_grad():
        ref, _, _ = full_forward(ref_model, batch)
    kl = batch["behavior_logprobs"][mask] - ref                 # k1 at each trainable token
    rows = mask.nonzero()[:, 0]
    penalty = torch.zeros(3).index_add_(0, rows, kl)
    torch.testing.assert_close(seen["rewards"], torch.tensor([1.0, 0.0, 0.5]) - 0.2 * penalty)
    assert metrics["kl"] == pytest.approx(float(kl.mean()), rel=1e-5)
    torch.testing.assert_close(batch["advantages"], seen["rewards"][:, None] *
                               batch["attention_mask"])

    batch, adv, metrics = training_batch(trajs, per_token, replace(alg, estimator_args={
        "scale": 2.0}), policy, 1.0, 0)
    want = torch.zeros(mask.shape)
    want[mask] = -0.2 * kl
    want[0, 4] += 1.0                              # the reward sits on the last trainable token
    want[2, 1] += 0.5
    torch.testing.assert_close(seen["token_rewards"], want)
    torch.testing.assert_close(seen["values"], policy.values(batch))
    assert seen["groups"].tolist() == [0, 0, 1] and torch.equal(seen["mask"], mask)
    torch.testing.assert_close(batch["advantages"], 2.0 * want)
    torch.testing.assert_close(batch["returns"], (want + seen["values"]) * mask)
    assert torch.equal(batch["old_values"], seen["values"]) and torch.equal(adv, 2 * want[mask])
    assert {"value/mean", "value/explained_variance", "kl"} <= metrics.keys()


def test_training_loop_reports_kl_and_entropy_from_the_recipe(ray_local, tiny_chars_dir):
    from molt_core.cli import load
    from molt_core.trainer import train

    cfg, plugins = load("recipes/cpu/next_letter.yaml", [
        f"model.path={tiny_chars_dir}", "trainer.steps=4", "rollout.groups_per_step=4",
        "algorithm.terms.kl_coef=0.1", "algorithm.terms.kl_estimator=k3",
        "algorithm.terms.entropy_coef=0.01"])
    history = train(cfg, plugins, None, progress=False)
    assert history[0]["kl"] == 0.0                      # step 0: the policy is pi_ref
    assert all(h["kl"] > 0 for h in history[1:])         # then it moves away, and KL says so
    vocab = AutoConfig.from_pretrained(tiny_chars_dir).vocab_size
    assert all(0 < h["entropy"] <= math.log(vocab) for h in history)


def test_estimator_outputs_of_the_wrong_shape_are_one_clear_error(policies):
    _, made = policies
    trajs = [_traj([5, 6], [8, 9], [-1.0, -2.0], 1.0, 0), _traj([5], [10], [-0.5], 0.0, 0)]
    alg = AlgorithmConfig(estimator="bad")

    def per_rollout(rewards, group_index):
        return rewards[:, None]

    def per_token(rewards, values, mask, group_index):
        return rewards                                   # forgot the returns
    per_token.needs_values = True
    with pytest.raises(PluginError, match=r"estimator 'bad' must return advantages \[R\].*"
                                          r"shape \(2,\); got \[\(2, 1\)\]"):
        training_batch(trajs, per_rollout, alg, made["one"], 1.0, 0)
    with pytest.raises(PluginError, match=r"'bad' must return \(advantages, returns\).*"
                                          r"needs_values.*\(2, 4\); got \[\(2, 4\)\]"):
        training_batch(trajs, per_token, alg, made["one"], 1.0, 0)
