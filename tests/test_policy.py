"""fsdp2 trainer backend and weight push: real Ray actors, real gloo process groups, tiny Qwen3."""

from __future__ import annotations

import asyncio
import math
import sys
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from molt_core.algos import masked_mean
from molt_core.cli import load
from molt_core.config import LoraConfig, TrainerConfig
from molt_core.engines.hf import HFEngine
from molt_core.policy.handle import Policy
from molt_core.policy.objective import TrainStep
from molt_core.consistency import ForwardConsistencyError, check_consistency
from molt_grpo import ppo_clip_loss

from common import reference_logprobs

# Workers cannot import this test module: ship its functions (the loss) by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

B_ROWS = 7          # odd: the 2-rank policy pads one dummy row
CLIPS = {"tight": 1e-3, "wide": 100.0}
BF16_LR = 1e-6      # far below half a bf16 ulp of the tiny model's weights


@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return str(tiny_model_dir)


def ppo_clip(logprobs, behavior_logprobs, advantages, mask, clip: float = 0.2):
    ratio = torch.exp(logprobs - behavior_logprobs)
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    return per_token, {"clipfrac": ((ratio - 1).abs() > clip).float(),
                       "ratio_mean": masked_mean(ratio.detach(), mask)}


def make_batch(model_path: str, B: int = B_ROWS, T: int = 20, seed: int = 0, shared: int = 0
               ) -> dict[str, torch.Tensor]:
    """Right-padded rows of different lengths; row 1 has no trainable token; the rows' first
    `shared` tokens are the same and not trainable (a group's prompt: one rank runs it once)."""
    g = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long),
             "attention_mask": torch.zeros(B, T, dtype=torch.bool),
             "loss_mask": torch.zeros(B, T, dtype=torch.bool),
             "advantages": torch.zeros(B, T), "versions": torch.full((B, T), -1)}
    for i in range(B):
        n = T - (3 * i) % 11
        prompt = max(2 + i % 4, shared)
        batch["input_ids"][i, :n] = torch.randint(1, 500, (n,), generator=g)
        batch["input_ids"][i, :shared] = batch["input_ids"][0, :shared]
        batch["attention_mask"][i, :n] = True
        if i != 1:
            batch["loss_mask"][i, prompt:n] = True
        batch["advantages"][i, :n] = torch.randn((), generator=g)
    batch["versions"][batch["loss_mask"]] = 0
    ref = reference_logprobs(AutoModelForCausalLM.from_pretrained(model_path), batch)
    noise = 0.05 * torch.randn(B, T, generator=g)
    batch["behavior_logprobs"] = (ref + noise).clamp(max=0) * batch["loss_mask"]
    return batch


def start(model_path: str, dtype: str = "float32", **trainer) -> Policy:
    return Policy(model_path, TrainerConfig(**{"lr": 1e-3, "timeout_s": 60.0,
                                               "weight_sync_transport": "ray", **trainer}),
                  dtype=dtype)


def assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"max parameter difference {worst}"


class ProbeEngine(HFEngine):
    """The real HF engine plus a parameter read-out and an optional stall per bucket (tests only:
    a stalled engine must time the push out)."""

    def __init__(self, model_path: str, stall_s: float = 0.0, **kw) -> None:
        super().__init__(model_path, **kw)
        self.stall_s = stall_s

    async def update_weights(self, named_tensors, version) -> None:
        await asyncio.sleep(self.stall_s)
        await super().update_weights(named_tensors, version)

    async def state(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self._version, {n: p.detach().clone() for n, p in self.model.named_parameters()}


def engine(model_path: str, **kw):
    return ray.remote(ProbeEngine).options(num_cpus=0).remote(model_path, **kw)


@pytest.fixture(scope="module")
def cluster(ray_local, model_path):
    """Started together (actor start-up is mostly imports): three policies and two engines.

    one: 1 rank, one micro-batch; micro: 1 rank, micro-batches of 3 rows; two: 2 ranks, one row
    per micro-batch (so some micro-batches hold no trainable token), lm_head chunks of 3 tokens.
    mb4/{none,tis}/{tight,wide}: 4 optimizer steps per batch; bf16: bf16 compute, lr 1e-6.
    """
    engines = [engine(model_path) for _ in range(2)]
    # one/micro/two compare updates to 1e-5: Adam's eps bounds how much it scales an entry's
    # summation-order noise (eps 1e-8: an entry whose gradient is ~1e-8 moved ~1e-5 apart, CI)
    same = {"eps": 1e-6}
    policies = {"one": start(model_path, micro_batch_size=64, **same),
                "micro": start(model_path, micro_batch_size=3, weight_sync_timeout_s=1.0, **same),
                "two": start(model_path, num_ranks=2, micro_batch_size=1, logprob_chunk=3,
                             weight_sync_bucket_mb=0.05, **same),
                **{f"mb4/{c}/{clip}": start(model_path, mini_batches=4)
                   for c in ("none", "tis") for clip in CLIPS},
                "bf16": start(model_path, "bfloat16", lr=BF16_LR)}
    ray.get([e.state.remote() for e in engines])
    yield policies, engines
    for p in policies.values():
        p.shutdown()
    for e in engines:
        ray.kill(e)


TRAINED_LP: dict[str, list] = {}     # policy -> [(logprobs before train, trained_logprobs)]


@pytest.fixture(scope="module")
def trained(cluster, model_path):
    """Two identical optimizer steps on every policy (token-mean, then seq-mean-token-mean)."""
    policies, _ = cluster
    policies = {k: policies[k] for k in ("one", "micro", "two")}
    metrics = {name: [] for name in policies}
    for seed, agg in ((0, "token-mean"), (1, "seq-mean-token-mean")):
        batch = make_batch(model_path, seed=seed, shared=8 * seed)
        for name, p in policies.items():
            before = p.logprobs(batch)
            metrics[name].append(p.train(batch, TrainStep(ppo_clip, {"clip": 0.2}, agg)))
            TRAINED_LP.setdefault(name, []).append((before, p.trained_logprobs()))
    params = {name: p.full_params() for name, p in policies.items()}
    return metrics, params


def test_two_ranks_match_one_rank(trained):
    metrics, params = trained
    for m1, m2 in zip(metrics["one"], metrics["two"]):
        for k in ("loss", "grad_norm", "clipfrac", "ratio_mean", "mismatch/kl", "mismatch/max_abs"):
            assert m1[k] == pytest.approx(m2[k], abs=1e-5), k
        assert {"train/fwd_bwd_s", "train/optim_s"} <= m1.keys()
    assert 0 < metrics["one"][0]["mismatch/max_abs"] < 0.3          # the injected noise
    assert_params_close(params["one"], params["two"])


def test_trained_logprobs_are_what_the_step_trained_with(trained):
    """What the trajectory store saves: the pre-update log-probs, across ranks and micro-batches."""
    for name, pairs in TRAINED_LP.items():
        for before, got in pairs:
            assert got.shape == before.shape, name
            assert torch.allclose(got, before, atol=1e-5), name
            assert (got != 0).any()


def test_micro_batches_do_not_change_the_update(trained):
    metrics, params = trained
    for m1, m3 in zip(metrics["one"], metrics["micro"]):
        for k in ("loss", "grad_norm"):     # Adam hides gradient scale: compare the norm too
            assert m1[k] == pytest.approx(m3[k], abs=1e-6), k
    assert_params_close(params["one"], params["micro"])


@pytest.mark.parametrize("name,shared", [("two", 0), ("one", 8)])   # one rank: shared context
def test_chunked_logprobs_match_full_forward(cluster, trained, model_path, name, shared):
    policies, _ = cluster
    batch = make_batch(model_path, seed=2, shared=shared)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(trained[1][name], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}     # tied to embed_tokens
    ref = reference_logprobs(model, batch)
    lp = policies[name].logprobs(batch)
    assert lp.shape == ref.shape
    assert (lp[~batch["loss_mask"]] == 0).all()
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


def test_push_weights_after_training(cluster, trained):
    policies, engines = cluster
    t0 = time.perf_counter()
    stats = policies["two"].push_weights(engines, version=2)
    print(f"push: {stats} ({time.perf_counter() - t0:.3f}s incl. RPC)")
    assert stats["buckets"] > 1
    trainer = trained[1]["two"]
    for e in engines:
        version, params = ray.get(e.state.remote())
        assert version == 2
        assert params.keys() == trainer.keys()
        assert all(params[k].dtype == trainer[k].dtype for k in trainer)
        assert_params_close(params, trainer, atol=0.0)


def test_push_to_stalled_engine_times_out_clearly(cluster, model_path):
    policies, engines = cluster
    stalled = engine(model_path, stall_s=60.0)
    try:
        ray.get(stalled.state.remote())
        with pytest.raises(TimeoutError, match=r"engine 1 .*update_weights.*within 1.0s"):
            policies["micro"].push_weights([engines[0], stalled], version=3)
    finally:
        ray.kill(stalled)


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_mini_batches_make_the_clip_act(cluster, model_path, correction):
    """4 optimizer steps per batch: from the second on pi_theta != pi_prox, so the clip shapes the
    update also with a correction (ratio to pi_prox), as without one (ratio to pi_behavior)."""
    policies, _ = cluster
    batch = make_batch(model_path, seed=3)
    start = policies[f"mb4/{correction}/tight"].full_params()
    params, metrics = {}, {}
    for clip, eps in CLIPS.items():
        p = policies[f"mb4/{correction}/{clip}"]
        metrics[clip] = p.train(batch, TrainStep(ppo_clip_loss, {"clip_low": eps, "clip_high": eps},
                                "token-mean", correction=correction, correction_args={}))
        params[clip] = p.full_params()
    assert metrics["tight"]["clip_fraction"] > 0.1 and metrics["wide"]["clip_fraction"] == 0
    # the steps moved the policy away from the weights the engine sampled with, and pi_prox
    # (the mismatch metrics) is still those weights
    assert metrics["tight"]["mismatch/max_abs"] == pytest.approx(
        metrics["wide"]["mismatch/max_abs"], abs=1e-6)
    moved = {c: max((params[c][k] - start[k]).abs().max().item() for k in start) for c in CLIPS}
    assert min(moved.values()) > 1e-4, moved
    diff = max((params["tight"][k] - params["wide"][k]).abs().max().item() for k in start)
    assert diff > 1e-4, "clip 0.001 and clip 100 gave the same update"


def test_bf16_compute_keeps_fp32_master_weights(cluster, model_path):
    """An lr-sized AdamW step, which bf16 weights would round away, moves the fp32 masters; the
    engines get bf16 weights (the dtype the real HF engine checks)."""
    policies, _ = cluster
    p = policies["bf16"]
    before = p.full_params(master=True)
    assert {t.dtype for t in before.values()} == {torch.float32}
    p.train(make_batch(model_path, seed=4), TrainStep(ppo_clip_loss, {}, "token-mean"))
    after = p.full_params(master=True)
    name = "model.layers.0.mlp.down_proj.weight"
    step = (after[name] - before[name]).abs()
    # AdamW's first step: lr * g / (|g| + eps), about lr wherever there is a gradient
    assert ((step > 0.5 * BF16_LR) & (step < 1.01 * BF16_LR)).float().mean() > 0.9
    pure = (before[name].bfloat16().float() + after[name] - before[name]).bfloat16()
    assert (pure == before[name].bfloat16()).float().mean() > 0.9     # lost in bf16 weights
    bf16 = engine(model_path, dtype="bfloat16")
    try:
        p.push_weights([bf16], version=1)
        version, params = ray.get(bf16.state.remote(), timeout=60)
        assert version == 1 and params[name].dtype == torch.bfloat16
        assert torch.equal(params[name], after[name].bfloat16())
    finally:
        ray.kill(bf16)


def test_nonfinite_steps_are_skipped_and_abort_in_a_row(cluster, trained, model_path):
    """Last in the module: it trains the 2-rank policy further. A row of rank 1 only holds a NaN
    behavior log-prob (the gap is NaN and fails the consistency check; the ratio's denominator is
    pi_prox, so it does not reach the loss) and a NaN advantage (the loss is NaN): the step is
    skipped on both ranks, the weights stay; a finite batch trains again; max_nonfinite_steps in
    a row abort."""
    p = cluster[0]["two"]
    bad = make_batch(model_path, seed=5)
    bad["behavior_logprobs"][5, bad["loss_mask"][5].nonzero()[0]] = float("nan")
    bad["advantages"][5, bad["loss_mask"][5].nonzero()[0]] = float("nan")
    before = p.full_params()
    m = p.train(bad, TrainStep(ppo_clip_loss, {}, "token-mean"))
    assert math.isnan(m["mismatch/max_abs"]) and m["faults/nonfinite_steps"] == 1
    cfg = load(None, [f"model.path={model_path}", "agent.args.env=next_letter"])[0]
    with pytest.raises(ForwardConsistencyError):
        check_consistency(cfg, 0, m)
    assert_params_close(p.full_params(), before, atol=0.0)
    m = p.train(make_batch(model_path, seed=6), TrainStep(ppo_clip_loss, {}, "token-mean"))
    assert math.isfinite(m["loss"]) and m["faults/nonfinite_steps"] == 1
    after = p.full_params()
    assert all(t.isfinite().all() for t in after.values())
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 0
    for _ in range(2):
        p.train(bad, TrainStep(ppo_clip_loss, {}, "token-mean"))
    with pytest.raises(RuntimeError, match=r"3 optimizer steps in a row.*max_nonfinite_steps=3"):
        p.train(bad, TrainStep(ppo_clip_loss, {}, "token-mean"))
    assert_params_close(p.full_params(), after, atol=0.0)


def test_packed_shared_prompts_are_the_rows_own_forward(model_path):
    """`molt_eager` (one CPU rank, bf16 rows) packs the distinct prompts and the rows continuing
    them into one forward (`logprobs._trunk`): the log-probs, entropies and gradients of the
    rows' own forward (fp64; two prompts, right-padded rows, a row with nothing to train)."""
    from molt_core.policy.logprobs import token_logprobs
    batch = make_batch(model_path, seed=2, shared=8)
    batch["input_ids"][B_ROWS // 2:, :8] = torch.arange(1, 9)              # a second prompt
    out, calls = [], []
    for share in (False, True):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
        model.config._attn_implementation = "molt_eager"
        model.model.register_forward_pre_hook(
            lambda m, a, k: calls.append(k["input_ids"].shape), with_kwargs=True)
        fwd = token_logprobs(model, batch, 1.0, 64, share_context=share)
        (fwd.logprobs.sum() + fwd.entropy.sum()).backward()
        out.append((fwd.logprobs, fwd.entropy, *(p.grad for p in model.parameters())))
    assert len(calls) == 2 and calls[0][0] == B_ROWS and calls[1][0] == 1    # packed: one row
    assert (out[0][0] != 0).sum() > B_ROWS
    for got, want in zip(out[1], out[0]):       # attention's softmax is fp32 in either
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_grouped_eager_attention_is_hfs_eager():
    """The trainer's attention for short CPU bf16 rows (`molt_eager`: a KV head's G query heads
    as G x T rows of one matmul) is HF's eager attention with repeat_kv: outputs and gradients,
    causal and padding mask included."""
    import types
    from transformers.models.llama.modeling_llama import eager_attention_forward
    from molt_core.policy.logprobs import _grouped_eager
    torch.manual_seed(0)
    (b, h, kv, t, s, d), out = (2, 6, 2, 5, 8, 4), []
    mask = torch.full((t, s), -1e9).triu(s - t + 1).repeat(b, 1, 1, 1)
    mask[1, ..., :2] = -1e9                                          # row 1: left padding
    module = types.SimpleNamespace(num_key_value_groups=h // kv, training=False)
    qkv0 = torch.randn(b, h, t, d), torch.randn(b, kv, s, d), torch.randn(b, kv, s, d)
    for fn in (eager_attention_forward, _grouped_eager):
        qkv = [x.clone().requires_grad_() for x in qkv0]
        y = fn(module, *qkv, mask, 0.5)[0]
        y.mul(torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        out.append((y, *(x.grad for x in qkv)))
    for got, want in zip(*out):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fast_norms_are_hfs_rmsnorm(dtype):
    """`fast_norms`: HF's RMSNorm as one autograd node, the same output bit for bit; x's and the
    weight's gradients autograd's (fp64 exactly, bf16 within its rounding)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from molt_core.policy.logprobs import fast_norms
    torch.manual_seed(0)
    norms, out = [LlamaRMSNorm(24, eps=1e-5).to(dtype) for _ in range(2)], []
    fast_norms(norms[1])
    x0, g = torch.randn(3, 5, 24, dtype=dtype) * 3, torch.randn(3, 5, 24, dtype=dtype)
    for n in norms:
        n.weight.data = torch.linspace(0.5, 2, 24, dtype=dtype)
        x = x0.clone().requires_grad_()
        y = n(x)
        y.mul(g).sum().backward()
        out.append((y, x.grad, n.weight.grad))
    assert torch.equal(out[0][0], out[1][0])
    tol = {} if dtype == torch.float64 else {"rtol": 0.02, "atol": 0.05}
    for got, want in zip(out[1][1:], out[0][1:]):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("lora", [0, 4])
def test_trainer_forwards_run_without_dropout(ray_local, model_path, tmp_path, lora):
    """Policy and reference run in eval mode: with attention dropout 0.5 in the config, every
    trainer forward (log-probs, reference, the loss's) is the plain eval forward, bit-stable."""
    import json
    import shutil
    path = shutil.copytree(model_path, tmp_path / "dropout")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"attention_dropout": 0.5}))
    batch = make_batch(str(path))
    want = batch["behavior_logprobs"] = reference_logprobs(
        AutoModelForCausalLM.from_pretrained(path), batch)
    policy = start(str(path), lora=LoraConfig(rank=lora, alpha=8.0))
    try:
        first = policy.logprobs(batch)
        assert torch.equal(first, policy.logprobs(batch))
        for got in (first, policy.ref_logprobs(batch)):
            assert (got - want).abs().max() < 1e-4
        assert policy.train(batch, TrainStep(ppo_clip, {}, "token-mean"))["mismatch/max_abs"] < 1e-4
    finally:
        policy.shutdown()
