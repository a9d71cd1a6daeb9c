"""The optimizer a TRL user expects (issue 41.9): HF's lr schedules with warmup, no weight decay
on biases and norm weights, Adam's eps; on the real fsdp2 worker (one CPU rank in the driver:
FSDP2 DTensors for full fine-tuning, a plain module with LoRA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer,
                          get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

from molt_core.config import ConfigError, LoraConfig, TrainerConfig, load_config
from molt_core.policy.handle import Policy
from molt_core.policy.objective import TrainStep
from molt_core.policy.worker import PolicyWorker, gathered
from molt_grpo import ppo_clip_loss

from test_policy import make_batch


@pytest.fixture(scope="module")
def biased_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 with attention biases: biases, RMSNorms (q_norm, layernorms, final norm)
    and linear weights side by side."""
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.attention_bias = True
    out = tmp_path_factory.mktemp("biased")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def _run(path: Path, fn, **trainer):
    policy = Policy(str(path), TrainerConfig(timeout_s=60.0, weight_sync_transport="ray",
                                             **trainer))
    assert policy.in_driver
    try:
        return fn(policy.workers[0].worker)
    finally:
        policy.shutdown()


def _zero_grad_step(w: PolicyWorker, critic: torch.nn.Module | None = None) -> None:
    """One real optimizer step (`_optimizer_step`: clip, schedule) on gradients of 1e-15: Adam
    moves an entry by <= lr * 1e-15 / eps (an exactly zero gradient skips the step)."""
    for p in (p for g in w.optim.param_groups for p in g["params"]):
        p.grad = torch.full_like(p, 1e-15)
    w._optimizer_step(0.0, critic)


def _full(w: PolicyWorker) -> dict[str, torch.Tensor]:
    return {n: gathered(p).detach().clone() for n, p in w.model.named_parameters()}


def test_weight_decay_spares_biases_and_norm_weights(biased_dir):
    """lr 0.1, weight_decay 0.5, ~zero gradients: Adam's update is ~0, so only decay moves a
    parameter: linear weights and embeddings shrink by 1 - 0.05, biases and norm weights stay."""
    def step(w: PolicyWorker):
        assert all(g["eps"] == 1e-3 for g in w.optim.param_groups)       # trainer.eps
        before = _full(w)
        head = w._critic()         # the critic's groups: its bias spared too
        assert [g["weight_decay"] for g in w.critic_groups] == [0.5, 0.0]
        _zero_grad_step(w, head)
        return before, _full(w)

    before, after = _run(biased_dir, step, lr=0.1, weight_decay=0.5, eps=1e-3)
    spared = {n for n in before if n.endswith("bias") or "norm" in n}
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.input_layernorm.weight", "model.norm.weight"} <= spared
    for n in before:
        torch.testing.assert_close(after[n], before[n] if n in spared else before[n] * 0.95,
                                   msg=n, rtol=1e-6, atol=1e-12)


def test_lora_groups_only_the_adapters(biased_dir):
    """With LoRA the frozen base (its biases and norms included) is in no group; the adapters
    (weights, no biases) all decay."""
    def groups(w: PolicyWorker):
        trainable = {id(p) for p in w.model.parameters() if p.requires_grad}
        grouped = [(g["weight_decay"], id(p)) for g in w.optim.param_groups for p in g["params"]]
        return trainable, grouped

    trainable, grouped = _run(biased_dir, groups, weight_decay=0.1, lora=LoraConfig(rank=4))
    assert {p for _, p in grouped} == trainable and len(grouped) == len(trainable)
    assert {wd for wd, _ in grouped} == {0.1}


def test_a_step_with_no_learning_signal_changes_nothing(tiny_model_dir):
    """After a real step (AdamW has momentum; weight decay 0.1), a batch whose advantages are all
    0 (every group flat) leaves every weight, every moment and the schedule as they were, and is
    counted (`train/no_signal_steps`); with an entropy term the same batch has a gradient and
    trains. Before, AdamW stepped on the zero gradient (momentum, decay)."""
    def state(w: PolicyWorker) -> dict[str, torch.Tensor]:
        moments = {f"{i}.{k}": gathered(v).detach().clone()
                   for i, s in enumerate(w.optim.state.values()) for k, v in s.items()}
        return {**_full(w), **moments, "lr": torch.tensor(w.optim.param_groups[0]["lr"])}

    def steps(w: PolicyWorker):
        batch = make_batch(str(tiny_model_dir))
        flat, spec = {**batch, "advantages": torch.zeros_like(batch["advantages"])}, TrainStep(
            ppo_clip_loss)
        out = w.train_step(batch, spec, int(batch["loss_mask"].sum()), 6)
        before = state(w)
        skipped = w.train_step(flat, spec, int(batch["loss_mask"].sum()), 6)
        after = state(w)
        entropy = TrainStep(ppo_clip_loss, terms={"entropy_coef": 0.01})
        trained = w.train_step(flat, entropy, int(batch["loss_mask"].sum()), 6)
        return out, before, skipped, after, trained, state(w)

    policy = Policy(str(tiny_model_dir), TrainerConfig(timeout_s=60.0, weight_decay=0.1,
                                                       lr_schedule="linear", steps=10))
    try:
        out, before, skipped, after, trained, last = steps(policy.workers[0].worker)
        assert out["grad_norm"] > 0 and before.keys() == after.keys()
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert not changed, f"a step with no learning signal changed {changed[:5]}"
        assert skipped["no_signal"] and skipped["grad_norm"] == 0 and not skipped["nonfinite"]
        flat = make_batch(str(tiny_model_dir), seed=3)
        assert policy.train(flat, TrainStep(ppo_clip_loss))["train/no_signal_steps"] == 0
        flat["advantages"].zero_()
        assert policy.train(flat, TrainStep(ppo_clip_loss))["train/no_signal_steps"] == 1
    finally:
        policy.shutdown()
    assert not trained["no_signal"] and trained["grad_norm"] > 0
    assert any(not torch.equal(after[k], last[k]) for k in after)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_lr_follows_hf_schedules_with_warmup(tiny_model_dir, schedule):
    """The lr of each optimizer step equals transformers' get_*_schedule_with_warmup over the
    run's optimizer steps (steps x mini_batches = 10, warmup 3), two past the end included;
    a skipped (non-finite) step does not advance it."""
    def lrs(w: PolicyWorker) -> list[float]:
        out = []
        for i in range(12):
            out.append(w.optim.param_groups[0]["lr"])
            if i == 5:                                  # skipped: the same lr again
                w._optimizer_step(float("nan"), None)
                assert w.optim.param_groups[0]["lr"] == out[-1]
            _zero_grad_step(w)
        return out

    got = _run(tiny_model_dir, lrs, lr=0.02, lr_schedule=schedule, warmup_steps=3, steps=5,
               mini_batches=2)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.02)
    ref = (get_constant_schedule_with_warmup(opt, 3) if schedule == "constant" else
           {"linear": get_linear_schedule_with_warmup,
            "cosine": get_cosine_schedule_with_warmup}[schedule](opt, 3, 10))
    want = []
    for _ in range(12):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert got == want
    assert got[:4] == pytest.approx([0.0, 0.02 / 3, 0.04 / 3, 0.02])
    assert (got[10] == 0.0) is (schedule != "constant")      # the end: 0 (HF's cosine: 0 there)


def test_two_ranks_resume_the_schedule_bit_identically(ray_local, tiny_model_dir, tmp_path):
    """Two FSDP2 ranks, linear with warmup: 3 steps, checkpoint, 2 more; a fresh policy loading
    the checkpoint takes the same 2 steps (lr and weights bit for bit; the saved AdamW lr alone
    gets the first of them right)."""
    cfg = TrainerConfig(num_ranks=2, lr=0.02, lr_schedule="linear", warmup_steps=2, steps=8,
                        timeout_s=60.0, weight_sync_transport="ray")
    batch, spec = make_batch(str(tiny_model_dir)), TrainStep(ppo_clip_loss)
    runs = []
    for resume in (False, True):
        policy = Policy(str(tiny_model_dir), cfg)
        try:
            if resume:
                policy.load_checkpoint(str(tmp_path), critic=False)
            else:
                lrs = [policy.train(batch, spec)["train/lr"] for _ in range(3)]
                policy.save_checkpoint(str(tmp_path))
            runs.append(([policy.train(batch, spec)["train/lr"] for _ in range(2)],
                         policy.full_params()))
        finally:
            policy.shutdown()
    assert lrs == [0.0, 0.01, 0.02] and runs[0][0] == runs[1][0] == [0.02 * (5 / 6), 0.02 * (4 / 6)]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


@pytest.mark.parametrize("bad,says", [("trainer.warmup_steps=-1", "warmup_steps must be >= 0"),
                                      ("trainer.eps=0", "eps > 0"),
                                      ("trainer.lr_schedule=step", "lr_schedule")])
def test_bad_optimizer_values_are_one_clear_error(bad, says):
    with pytest.raises(ConfigError, match=says):
        load_config("recipes/cpu/next_letter.yaml", [bad])
