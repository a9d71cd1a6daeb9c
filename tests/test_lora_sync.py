"""Adapter-only LoRA weight sync (issue 43 items 1, 2, 4): `trainer.lora.sync: adapter` pushes A, B
and the scaling, the hf engine applies them unmerged, per row, several adapters and the base in
one batch. Real fsdp2 trainer, real HF engines (Ray actors and in-process), real runs."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest
import ray
import torch

from common import toy_recipe
from molt_core.cli import load
from molt_core.config import ConfigError, LoraConfig, TrainerConfig, load_config
from molt_core.engines.hf import HFEngine
from molt_core.policy.handle import Policy
from molt_core.policy.objective import TrainStep
from molt_core.trainer import train
from molt_core.weight_sync import WeightMismatchError
from molt_grpo import ppo_clip_loss

from common import sample_batch as sample
from test_lora import SAMPLING, sample_batch

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOL = 1e-4      # fp32 log-probs, adapter vs merged (measured: <= 1e-6)


def _run(tmp_path, model, *args: str, plugins=()) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg, plugins = load(toy_recipe(tmp_path, model), [
        "trainer.steps=2", "trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.lr=0.01",
        "log.trajectories_every=1", "check.canary_every=1", "check.consistency_every=1", *args],
        list(plugins))
    return train(cfg, plugins, tmp_path, progress=False)


def _saved(run_dir) -> list[dict]:
    import pyarrow.parquet as pq
    return [r for f in sorted(run_dir.rglob("trajectories/step_*.parquet"))
            for r in pq.read_table(f).to_pylist()]


def test_adapter_sync_run_equals_merged_run(ray_local, tiny_chars_dir, tmp_path):
    """Two steps of the toy run, LoRA r4, fp32, canary on every sync and the forward check on
    every step: merged and adapter sync sample the same tokens with the same log-probs (within
    TOL), train to the same losses; the adapter run's engine holds the base and the adapter."""
    rows = {m: _run(tmp_path / m, tiny_chars_dir, f"trainer.lora.sync={m}")
            for m in ("merged", "adapter")}
    for a, b in zip(rows["merged"], rows["adapter"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=TOL)
        assert b["mismatch/max_abs"] < 1e-3 and b["check/canary_max_abs"] < 1e-3
    saved = {m: _saved(tmp_path / m) for m in rows}
    assert len(saved["adapter"]) == len(saved["merged"]) == 2 * 16
    assert {v for r in saved["adapter"] for v, m in zip(r["versions"], r["loss_mask"]) if m
            } == {0, 1}                                           # step 2: the pushed adapter
    for a, b in zip(saved["merged"], saved["adapter"]):
        assert a["token_ids"] == b["token_ids"]
        gap = max(abs(x - y) for x, y in zip(a["behavior_logprobs"], b["behavior_logprobs"]))
        assert gap < TOL


def test_the_canary_covers_adapter_pushes(ray_local, tiny_chars_dir, tmp_path):
    """An engine that changes a weight after an adapter push's load fails that sync's canary."""
    with pytest.raises(WeightMismatchError, match=r"version 1: engine 0 .* canary text up to"):
        _run(tmp_path, tiny_chars_dir, "trainer.lora.sync=adapter", "engine.name=hf_corrupt",
             "engine.args.where=load", "engine.args.from_version=1", "log.trajectories_every=0",
             plugins=["corrupt_plugin"])


def test_a_bf16_adapter_run_passes_the_default_checks(ray_local, tiny_chars_dir, tmp_path):
    """bf16 base, fp32 adapters on both sides: the canary on every sync and the forward check on
    every step pass at their default tolerances (calibrated canary; bf16 1.0)."""
    rows = _run(tmp_path, tiny_chars_dir, "trainer.lora.sync=adapter", "model.dtype=bfloat16",
                "trainer.steps=3", "log.trajectories_every=0")
    assert rows[-1]["faults/weight_sync_mismatches"] == 0 and len(rows) == 3


def test_adapter_push_sends_only_a_b_and_the_scaling(ray_local, tiny_model_dir):
    """One step, then each mode pushes (adapter over shm and broadcast, with their checksums):
    adapter bytes = A and B (fp32) + 4 (the scaling) < merged bytes; the engines then sample the
    same tokens with the trainer's log-probs."""
    path = str(tiny_model_dir)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    cfg = dataclasses.replace(TrainerConfig(), lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0))
    policies = {m: Policy(path, dataclasses.replace(cfg, lora=dataclasses.replace(
        cfg.lora, sync=m), weight_sync_transport=t), seed=0)
        for m, t in (("merged", "broadcast"), ("adapter", "shm"))}
    engines = {m: ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=3)
               for m in ("merged", "adapter", "adapter-broadcast")}
    try:
        _, batch = sample_batch(engines["merged"], tok)
        for p in policies.values():
            p.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))
        stats = {m: p.push_weights([engines[m]], 1) for m, p in policies.items()}
        policies["adapter"].cfg.weight_sync_transport = "broadcast"
        again = policies["adapter"].push_weights([engines["adapter-broadcast"]], 1)
        lora_bytes = sum(t.numel() * 4 for t in policies["adapter"].full_params(True).values())
        assert stats["adapter"]["bytes"] == again["bytes"] == lora_bytes + 4
        assert stats["adapter"]["checksums"] == again["checksums"]
        assert stats["merged"]["bytes"] == sum(
            t.numel() * t.element_size() for t in policies["merged"].full_params().values())
        assert stats["adapter"]["bytes"] < stats["merged"]["bytes"] / 10
        prompts = [tok(f"after {c}", add_special_tokens=False).input_ids for c in "abcdefgh"]
        got = {m: sample(e, prompts, SAMPLING | {"seed": 7}) for m, e in engines.items()}
        for m in ("adapter", "adapter-broadcast"):
            assert torch.equal(got[m][2]["input_ids"], got["merged"][2]["input_ids"])
            assert ray.get(engines[m].stats.remote())["adapters"] == {"policy": 1}
            lp, mask = got[m][2]["behavior_logprobs"], got[m][2]["loss_mask"]
            trainer_lp = policies["adapter"].logprobs(got[m][2])
            assert (lp - got["merged"][2]["behavior_logprobs"]).abs()[mask].max() < TOL
            assert (lp - trainer_lp).abs()[mask].max() < TOL
    finally:
        for p in policies.values():
            p.shutdown()


def _adapter(engine: HFEngine, seed: int, rank: int = 4, every: int = 1) -> dict:
    """Random A, B on every `every`-th Linear but the head, as wire tensors, scaling 2."""
    g = torch.Generator().manual_seed(seed)
    lins = [(n, m) for n, m in engine.model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"][::every]
    named = {}
    for n, m in lins:
        named[f"{n}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.2
        named[f"{n}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.2
    return named | {"lora_scaling": torch.tensor(2.0)}


async def _load(engine: HFEngine, aid: str, named: dict, version: int) -> dict:
    prefix = f"{aid}/" if aid else ""
    await engine.update_weights([(prefix + n, t) for n, t in named.items()], version)
    return await engine.finish_weight_update(version)


def test_one_engine_serves_two_adapters_and_the_base_in_one_batch(tiny_model_dir):
    """Acceptance 2: rows of adapters a1, a2 (different ranks and targets) and the base decode
    in one wave; each row's tokens and log-probs are those of an engine holding only that
    adapter (or none)."""
    path = str(tiny_model_dir)
    prompts = [[5, 9, 11], [7, 8], [5, 9, 11], [12, 13, 14, 15], [7, 8]]
    use = ["a1", "a2", "base", "a1", None]      # None: the policy's adapter, here none: base
    sampling = [SAMPLING | {"seed": i, "max_new_tokens": 8} for i in range(len(prompts))]

    async def serve():
        shared = HFEngine(path)
        adapters = {"a1": _adapter(shared, 1), "a2": _adapter(shared, 2, rank=8, every=2)}
        for v, (aid, named) in enumerate(adapters.items(), 1):
            await _load(shared, aid, named, v)
        before = (await shared.stats())["batches"]
        got = await shared.generate_batch(
            prompts, [s | ({"adapter": a} if a else {}) for s, a in zip(sampling, use)])
        assert (await shared.stats())["batches"] == before + 1      # one wave, all five rows
        assert (await shared.stats())["adapters"] == {"a1": 1, "a2": 2}
        alone = []
        for p, s, a in zip(prompts, sampling, use):
            solo = HFEngine(path)
            if a in adapters:
                await _load(solo, "", adapters[a], 1)      # as its policy adapter
            alone.append(await solo.generate(p, s))
        return got, alone

    got, alone = asyncio.run(serve())
    for a, b, u in zip(got, alone, use):
        assert a.token_ids == b.token_ids, u
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL, u
    assert got[0].versions == [1] * 8 and got[1].versions == [2] * 8 and got[2].versions == [0] * 8
    assert got[0].logprobs != got[2].logprobs != got[1].logprobs


class _FlipsB(HFEngine):
    """Loads every adapter push with one B element changed (the bytes its checksums see)."""

    async def update_weights(self, named_tensors, version):
        named_tensors = [(n, t.clone().index_fill_(0, torch.tensor([0]), 9.0)
                          if n.endswith("q_proj.lora_B.weight") else t) for n, t in named_tensors]
        await super().update_weights(named_tensors, version)


def test_the_checksums_cover_adapter_pushes(tiny_model_dir):
    """`weight_sync.send` of an adapter stream: an engine holding other bytes in a B than sent
    is a WeightMismatchError naming it; a faithful engine's sums are the sender's."""
    from molt_core import weight_sync
    from molt_core.run.actors import LocalActor
    for cls in (HFEngine, _FlipsB):
        engine = LocalActor(cls, str(tiny_model_dir))
        try:
            named = _adapter(engine._instance, 1)
            push = lambda: weight_sync.send(iter(named.items()), [engine], 1, 2**20, 60)  # noqa
            if cls is HFEngine:
                assert push()["bytes"] == sum(t.numel() * 4 for t in named.values())
                continue
            with pytest.raises(WeightMismatchError, match=r"engine 0 .* first 'model.layers.0."
                               r"self_attn.q_proj.lora_B.weight' of bucket \d"):
                push()
        finally:
            engine.kill()


def test_bad_adapters_and_requests_are_one_clear_error_each(tiny_model_dir):
    """An adapter for another base (a shape, a module), one missing B or the scaling, one over
    engine max_adapters, a request for an unknown adapter: one error naming it; the engine goes
    on serving the others (no update left open, other rows of the batch answered)."""
    path = str(tiny_model_dir)

    async def check():
        engine = HFEngine(path, max_adapters=2)
        good = _adapter(engine, 1)
        await _load(engine, "a1", good, 1)
        q = "model.layers.0.self_attn.q_proj.lora_A.weight"
        bad = {"wide": good | {q: torch.zeros(4, good[q].shape[1] + 8)},
               "moved": good | {"model.layers.9.mlp.up_proj.lora_A.weight": good[q]},
               "no_b": {k: v for k, v in good.items() if "q_proj.lora_B" not in k},
               "no_s": {k: v for k, v in good.items() if k != "lora_scaling"}}
        why = {"wide": r".*q_proj.lora_A.weight' \[4, 72\] does not fit this engine's base model: "
                       r"Linear\(in_features=64, .* another base model",
               "moved": r".* does not fit .*: no Linear 'model.layers.9.mlp.up_proj'",
               "no_b": r"'model.layers.0.self_attn.q_proj' lacks lora_A or lora_B",
               "no_s": "no lora_scaling"}
        for aid, named in bad.items():
            with pytest.raises(ValueError, match=rf"adapter '{aid}' \(version 2\): {why[aid]}"):
                await _load(engine, aid, named, 2)
            assert not (await engine.stats())["updating"], aid
        await _load(engine, "a2", good, 2)
        with pytest.raises(ValueError, match=r"holds 2 adapters already \(engine.args."
                                             r"max_adapters\): raise it"):
            await _load(engine, "a3", good, 3)
        await _load(engine, "a1", _adapter(engine, 5), 4)       # replacing one: fine
        out = await engine.generate_batch([[5, 6]] * 3, [SAMPLING | {"adapter": a}
                                                         for a in ("a1", "nope", "base")])
        assert isinstance(out[1], ValueError) and "unknown adapter 'nope'" in str(out[1])
        assert out[0].versions == [4] * 6 and out[2].versions == [0] * 6
        return (await engine.stats())["adapters"]

    assert asyncio.run(check()) == {"a1": 4, "a2": 2}
    with pytest.raises(ConfigError, match=r"engine vllm cannot take LoRA adapters .* set "
                                          r"trainer.lora.sync: merged"):
        load_config(None, [f"model.path={path}", "engine.name=vllm", "trainer.lora.rank=4",
                           "trainer.lora.sync=adapter"])
