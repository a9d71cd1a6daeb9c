"""Real-model smoke (issue 13): SmolLM2-135M-Instruct with LoRA through the whole loop on CPU:
HF engine, FSDP2 trainer, forward consistency every step, held-out evaluation before and after.
Kept to two tiny steps (a 135M step takes ~10-20 s here); the learning run is bench/smollm2.py."""

from __future__ import annotations

from pathlib import Path

from molt_core.cli import load
from molt_core.trainer import train

RECIPE = Path(__file__).parents[1] / "recipes/cpu/smollm2_arithmetic.yaml"


def test_smollm2_lora_smoke(ray_local, smollm2_dir):
    cfg, plugins = load(str(RECIPE), [
        f"model.path={smollm2_dir}", "trainer.steps=2", "rollout.groups_per_step=2",
        "rollout.group_size=2", "sampling.max_new_tokens=6", "eval.every=2", "eval.prompts=2",
        "eval.k=2", "check.consistency_every=1", "check.consistency_tol=0.001",
        "model.dtype=float32"])       # the tight check: fp32 (the recipe's bf16 differs by ~0.3)
    # no run dir: no end-of-run checkpoint + HF export of the 135M model (~1 GB written)
    history = train(cfg, plugins, None, progress=False)
    steps = [h for h in history if "reward/mean" in h]
    evals = [h for h in history if "eval/time_s" in h]
    assert len(steps) == 2 and [e["step"] for e in evals] == [0, 2]
    for h in steps:      # the check raised above 1e-3; these are the measured gaps
        assert h["mismatch/max_abs"] < 1e-3 and h["memory/trainer_peak_gib"] > 0.3
        assert h["response/len_mean"] > 1          # multi-token replies
    assert steps[1]["version"] == 2
    assert all(0 <= e["eval/greedy/pass@1"] <= 1 for e in evals)
