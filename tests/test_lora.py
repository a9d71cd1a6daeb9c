"""LoRA (PEFT) on the fsdp2 trainer: only adapters train, engines get merged weights, the export
loads in transformers and PEFT with the trainer's log-probs. Real Ray, gloo (2 ranks), tiny Qwen3."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt_core.config import LoraConfig, TrainerConfig
from molt_core.engines.hf import HFEngine
from molt_core.policy.handle import Policy
from molt_core.policy.objective import TrainStep
from molt_tools.export import export_lora
from molt_grpo import ppo_clip_loss

from common import reference_logprobs
from common import sample_batch as sample

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_new_tokens": 6}


def sample_batch(engine, tok, n: int = 8):
    prompts = [tok(f"after {c}", add_special_tokens=False).input_ids for c in "abcdefgh"[:n]]
    adv = torch.randn(n, generator=torch.Generator().manual_seed(0))    # the same every run
    return sample(engine, prompts, SAMPLING, adv)[1:]


def _optimizer_state(worker) -> tuple[int, int]:
    """(params with AdamW state, LoRA params) on this rank."""
    state = [p for p in worker.optim.state if worker.optim.state[p]]
    n_lora = sum(".lora_" in n for n, _ in worker.model.named_parameters())
    assert all(p.requires_grad for p in state)
    return len(state), n_lora


def test_lora_trains_adapters_only_syncs_merged_and_exports(ray_local, tiny_model_dir, tmp_path):
    path = str(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=3)
    cfg = dataclasses.replace(TrainerConfig(), num_ranks=2, lr=1e-2,
                              lora=LoraConfig(rank=4, alpha=8.0, target_modules="all-linear"))
    policy = Policy(path, cfg, seed=0)
    try:
        base = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).named_parameters()}
        assert policy.full_params().keys() == base.keys()     # merged: the plain HF names
        _, batch = sample_batch(engine, tok)
        metrics = policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))
        assert metrics["mismatch/max_abs"] < 1e-4             # B = 0: the adapted model is base
        adapter, merged = policy.full_params(adapter=True), policy.full_params()
        b_names = [k for k in adapter if ".lora_B." in k]
        assert b_names and all(adapter[k].abs().max() > 0 for k in b_names)
        # only adapters changed: every merged weight is base (+ scaling * B @ A where adapted)
        adapted = 0
        for name, w in merged.items():
            stem = f"base_model.model.{name.removesuffix('.weight')}"
            expect = base[name]
            if f"{stem}.lora_A.weight" in adapter:
                a, b = adapter[f"{stem}.lora_A.weight"], adapter[f"{stem}.lora_B.weight"]
                expect, adapted = expect + (8.0 / 4) * b @ a, adapted + 1
            assert (w - expect).abs().max() < 1e-5, name
        assert adapted == len(b_names)
        for held, n_lora in ray.get([w.__ray_call__.remote(_optimizer_state)
                                     for w in policy.workers]):
            assert held == n_lora            # AdamW state on the adapters, nothing else
        # weight sync sends merged weights: the engine samples what the trainer computes
        policy.push_weights([engine], 1)
        trajs, batch = sample_batch(engine, tok)
        assert {v for t in trajs for v, m in zip(t.versions, t.loss_mask) if m} == {1}
        trainer_lp = policy.logprobs(batch)
        assert (trainer_lp - batch["behavior_logprobs"]).abs()[batch["loss_mask"]].max() < 1e-4
        # export: a merged HF directory and a PEFT adapter, both with the trainer's log-probs
        out = export_lora(policy, path, tmp_path / "export")
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert (reference_logprobs(exported, batch) - trainer_lp).abs().max() < 1e-4
        from peft import PeftModel
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), out / "adapter")
        assert (reference_logprobs(peft_model, batch) - trainer_lp).abs().max() < 1e-4
        # `molt eval ADAPTER_DIR`: the adapter merged into its base model
        from molt_tools.evaluate import model_dir
        merged_dir = model_dir(str(out / "adapter"), tmp_path / "merged")
        again = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
        assert (reference_logprobs(again, batch) - trainer_lp).abs().max() < 1e-4
    finally:
        policy.shutdown()
        ray.kill(engine)


def test_one_rank_keeps_merges_no_longer_than_a_step(ray_local, tiny_model_dir):
    """One CPU rank keeps each adapted layer's merged weight from a step's first forward to the
    reshard before its optimizer step (`lora.drop_merged`): after every step the trainer's
    log-probs are those of the merged weights it now sends, not of the weights before it."""
    path = str(tiny_model_dir)
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=3)
    cfg = dataclasses.replace(TrainerConfig(), num_ranks=1, lr=1e-2,
                              lora=LoraConfig(rank=4, alpha=8.0, target_modules="all-linear"))
    policy = Policy(path, cfg, seed=0)
    try:
        _, batch = sample_batch(engine, AutoTokenizer.from_pretrained(path))
        before = policy.logprobs(batch)
        for _ in range(2):
            policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            model.load_state_dict(policy.full_params(), strict=False)
            lp, mask = policy.logprobs(batch), batch["loss_mask"]
            assert (lp - before).abs()[mask].max() > 1e-3           # the step moved them
            assert (reference_logprobs(model, batch) - lp).abs()[mask].max() < 1e-4
            before = lp
    finally:
        policy.shutdown()
        ray.kill(engine)


def test_one_cpu_rank_runs_lora_without_fsdp_as_two_fsdp_ranks_do(ray_local, tiny_model_dir):
    """LoRA on one CPU rank is a plain module (no FSDP2: the bf16 base needs no sharding or
    casts; `lora` casts the fp32 adapters, their grads come back fp32): a bf16 step gives the
    loss, grad norm, adapters and log-probs that two FSDP2 ranks give on the same rows."""
    from torch.distributed.fsdp import FSDPModule
    path = str(tiny_model_dir)
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=3)
    _, batch = sample_batch(engine, AutoTokenizer.from_pretrained(path))
    ray.kill(engine)
    runs = []
    for n in (1, 2):
        cfg = dataclasses.replace(TrainerConfig(), num_ranks=n, lr=1e-2,
                                  lora=LoraConfig(rank=4, alpha=8.0, target_modules="all-linear"))
        policy = Policy(path, cfg, dtype="bfloat16", seed=0)
        try:
            if n == 1:
                model = policy.workers[0].worker.model
                assert not any(isinstance(m, FSDPModule) for m in model.modules())
                assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
            before = policy.logprobs(batch)
            spec = TrainStep(ppo_clip_loss, {}, "token-mean", 1.0)
            metrics = policy.train(batch, spec)
            after = policy.logprobs(batch), policy.full_params(adapter=True)
            runs.append((metrics, before, *after, policy.train(batch, spec)["loss"]))
        finally:
            policy.shutdown()
    (m1, b1, lp1, ad1, loss1), (m2, b2, lp2, ad2, loss2) = runs
    assert m1["grad_norm"] > 0 and m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-2)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=2e-2, abs=1e-3)
    assert loss1 == pytest.approx(loss2, rel=2e-2, abs=1e-3)     # step 2's forward: B != 0
    assert torch.equal(b1, b2)
    # Adam's first update is lr * sign(g): B moved +-lr nearly everywhere in both, and the few
    # entries whose gradient is at bf16 noise may land elsewhere (measured: none apart by 1e-2
    # in 40 batches, up to 3 of 4096 by 5e-3). A second step is no test: A's first update is
    # lr * sign(g) of a gradient through B's +-lr entries that mostly cancel, so those few
    # entries flip ~10 % of A's (measured, 3 batches of 48: grad norms 4-11 % apart, log-probs
    # apart up to 0.47x what they moved; the batch varies as the engine batches requests); its
    # loss, before its update, is step 1's outcome (0.02 % apart in the one checked).
    b_keys = [k for k in ad1 if ".lora_B." in k]
    moved_b = torch.cat([ad1[k].flatten() for k in b_keys]).abs()
    flipped = torch.cat([(ad1[k] - ad2[k]).flatten() for k in b_keys]).abs() > 5e-3
    assert (moved_b > 0.5e-2).float().mean() > 0.99 and flipped.sum() <= 8, flipped.sum()
    mask = batch["loss_mask"]
    moved, apart = (lp1 - b1).abs()[mask], (lp1 - lp2).abs()[mask]
    assert apart.mean() < 0.1 * moved.mean() and apart.max() < 0.2 * moved.max()


def test_lora_dropout_never_noises_trainer_logprobs(ray_local, tiny_model_dir):
    """Adapters' dropout stays off in every trainer forward (loss, pi_prox, saved log-probs): the
    ratio's log-probs are deterministic and those of the merged weights the engines sample."""
    path = str(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=3)
    cfg = dataclasses.replace(TrainerConfig(), lr=5e-2, lora=LoraConfig(
        rank=4, alpha=8.0, dropout=0.3, target_modules="all-linear"))
    policy = Policy(path, cfg, seed=0)
    try:
        spec = TrainStep(ppo_clip_loss, {}, "token-mean", 1.0)
        policy.train(sample_batch(engine, tok)[1], spec)        # B != 0: dropout would show
        _, batch = sample_batch(engine, tok)
        first, second = policy.logprobs(batch), policy.logprobs(batch)
        assert torch.equal(first, second)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.load_state_dict(policy.full_params(), strict=False)    # lm_head: tied
        assert (reference_logprobs(model, batch) - first).abs().max() < 1e-4
        policy.push_weights([engine], 1)
        _, batch = sample_batch(engine, tok)
        assert policy.train(batch, spec)["mismatch/max_abs"] < 1e-4    # the loss forward's
    finally:
        policy.shutdown()
        ray.kill(engine)


def test_adapted_linear_computes_the_engines_merged_weights():
    """In bf16 the trainer's adapted Linear is x (W + s B A)^T with the merged weight rounded
    as `lora.merged` rounds the engines' copy, bit for bit (adding s B A x apart, as PEFT does,
    keeps updates the engines' rounding drops); A's and B's gradients are that function's."""
    from molt_core.lora import _merge, _Merged, merged
    torch.manual_seed(0)
    w = torch.randn(48, 32).bfloat16()
    a, b = torch.randn(4, 32).bfloat16().float(), (torch.randn(48, 4) * 1e-3).bfloat16().float()
    x = torch.randn(2, 5, 32).bfloat16()
    engine_w = dict(merged(iter([("l.base_layer.weight", w), ("l.lora_A.default.weight", a),
                                 ("l.lora_B.default.weight", b)]), 2.0))["l.weight"]
    y = _Merged.apply(x, w, None, a.bfloat16(), b.bfloat16(), 2.0, None)
    assert torch.equal(y, torch.nn.functional.linear(x, engine_w))
    kept = _merge(w, a, b, 2.0, torch.bfloat16)          # a merge kept through the step: same
    assert torch.equal(_Merged.apply(x, w, None, a.bfloat16(), b.bfloat16(), 2.0, kept), y)
    peft_y = x @ w.T + (x @ a.bfloat16().T) @ b.bfloat16().T * 2.0
    assert not torch.equal(y, peft_y)          # the rounding this test is about is there
    # gradients in fp32 against autograd through W + s B A, merged now or kept
    a2, b2, x2 = a.clone().requires_grad_(), b.clone().requires_grad_(), x.float().requires_grad_()
    torch.nn.functional.linear(x2, w.float() + 2.0 * b2 @ a2).square().sum().backward()
    for keep in (None, _merge(w.float(), a, b, 2.0, torch.float32)):
        x32 = x.float().requires_grad_()
        a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
        _Merged.apply(x32, w.float(), None, a1, b1, 2.0, keep).square().sum().backward()
        for got, want in ((x32.grad, x2.grad), (a1.grad, a2.grad), (b1.grad, b2.grad)):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entropy", [0.0, 0.3])
def test_frozen_head_gradient_is_autograds(entropy):
    """A frozen lm_head (LoRA) makes d logp / dh in forward; a trained one (or entropy's gradient)
    recomputes the logits in backward: both are autograd's through log_softmax (temperature and
    banned ids included). Without the entropy term the loss must not touch `got_ent` at all: a
    0 * entropy still sends its gradient and takes the recompute path."""
    from molt_core.policy.logprobs import _Head
    torch.manual_seed(0)
    head, banned = torch.nn.Linear(16, 50, bias=False), torch.tensor([3, 7])
    h0, t, g = torch.randn(9, 16), torch.randint(8, 50, (9,)), torch.randn(9)
    h = h0.clone().requires_grad_()
    lp = (h @ head.weight.T / 0.7).index_fill(-1, banned, -1e30).log_softmax(-1)
    ent = -(lp.exp() * lp).sum(-1)
    (lp.gather(-1, t[:, None])[:, 0] * g + entropy * ent).sum().backward()
    for frozen in (True, False):
        head.weight.requires_grad_(not frozen)
        x = h0.clone().requires_grad_()
        got_lp, got_ent = _Head.apply(x, t, head, banned, 0.7)
        (got_lp * g + entropy * got_ent if entropy else got_lp * g).sum().backward()
        torch.testing.assert_close(x.grad, h.grad, rtol=1e-5, atol=1e-6)
