"""SFT then RL (issue 42 item 3): `model.init_from: RUN_DIR` starts a run from a `molt sft` run's
weights, its LoRA adapters carried over (`model.init_lora: carry`) or merged into the base
(`merge`); the run's config.yaml names the checkpoint it started from. Real runs on the tiny
model, the real trainer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from molt_core.cli import load
from molt_core.cli import start as run_start
from molt_core.config import ConfigError
from molt_core.lora import adapter_tensors
from molt_core.policy.handle import Policy
from molt_core.run.checkpoint import _policy_tensors
from molt_core.sft_trainer import start as sft_start

TEMPLATE = str(Path(__file__).parents[1] / "recipes/templates/smollm2_tools.jinja")
LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_model_dir) -> str:
    tmp = tmp_path_factory.mktemp("init_from")
    data = yaml.safe_load(open(Path(__file__).parents[1] / "recipes/cpu/next_letter.yaml"))
    data["model"]["path"], data["out_dir"] = str(tiny_model_dir), str(tmp / "runs")
    data["trainer"]["steps"] = 1
    data["rollout"] |= {"groups_per_step": 2, "group_size": 2}
    (tmp / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"after {c}", "completion": d})
                                            + "\n" for c, d in zip("abcdefg", "bcdefgh")))
    data["sft"] = {"data": str(tmp / "rows.jsonl"), "steps": 2, "batch_size": 4,
                   "eval_fraction": 0.0}
    (path := tmp / "recipe.yaml").write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def sft_run(recipe) -> Path:
    run_dir, _ = sft_start(recipe, [*LORA, "trainer.lr=0.05", f"model.chat_template={TEMPLATE}",
                                    "name=sft"], progress=False)
    return run_dir


def test_carried_adapters_are_the_sft_runs_and_engines_serve_them(recipe, sft_run, tiny_model_dir):
    cfg, _ = load(recipe, [f"model.init_from={sft_run}", "model.init_lora=carry", *LORA])
    ckpt = sft_run / "checkpoints/step_000002"
    assert (cfg.model.path, cfg.model.init_from) == (str(sft_run / "final"), str(ckpt))
    policy = Policy(cfg.model.init_from, cfg.trainer)
    try:
        adapters, merged = policy.full_params(adapter=True), policy.full_params()
    finally:
        policy.shutdown()
    want = adapter_tensors(iter(_policy_tensors(ckpt / "policy").items()))
    assert adapters.keys() == want.keys() and len(want) > 0
    assert all(torch.equal(adapters[k], want[k]) for k in want)
    final, base = load_file(sft_run / "final/model.safetensors"), load_file(
        tiny_model_dir / "model.safetensors")
    assert all(torch.equal(merged[k], final[k]) for k in final)       # the SFT run's weights
    assert any(not torch.equal(merged[k], base[k]) for k in final)    # not the base's
    # an RL step: engines (model.path: the merged weights) sample what the trainer computes
    run_dir, rl = run_start(recipe, [f"model.init_from={sft_run}", "model.init_lora=carry",
                                     *LORA, "name=rl"], progress=False)
    step = next(h for h in rl if "reward/mean" in h)
    assert step["mismatch/max_abs"] < 1e-4
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    assert (saved["init_from"], saved["init_lora"]) == (str(ckpt), "carry")


def test_merge_is_training_from_the_merged_model(recipe, sft_run):
    def run(overrides: list[str]) -> list[dict]:
        _, history = run_start(recipe, [*overrides, *LORA, "name=merge"], progress=False)
        return [{k: v for k, v in h.items()      # wall-clock and memory readings differ
                 if not (k.startswith(("time", "elapsed", "memory")) or k.endswith("_s"))}
                for h in history]
    assert run([f"model.init_from={sft_run}"]) == run([f"model.path={sft_run / 'final'}"])


def test_a_run_without_final_starts_from_its_latest_checkpoint(recipe, sft_run, tmp_path):
    src = shutil.copytree(sft_run, tmp_path / "stopped", ignore=shutil.ignore_patterns("final"))
    cfg, _ = load(recipe, [f"model.init_from={src}"])
    ckpt = src / "checkpoints/step_000002"
    assert (cfg.model.path, cfg.model.init_from) == (str(ckpt / "hf"), str(ckpt))
    got, want = (load_file(d / "model.safetensors") for d in (ckpt / "hf", sft_run / "final"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("where, overrides, why", [
    ("missing", [], "'.*missing' does not exist: name the run directory of a molt sft"),
    ("empty", [], "is neither a checkpoint .* nor a run directory with one under checkpoints"),
    ("sft", ["model.init_lora=carry", "trainer.lora.rank=8"],
     r"carry: .*step_000002's adapters are \{'rank': 4, 'alpha': 8.0, 'target_modules': "
     r"'all-linear'\} .*, this run's trainer.lora \{'rank': 8, .*or set model.init_lora=merge"),
    ("sft", ["model.init_lora=carry", *LORA, "trainer.lora.sync=adapter"],
     "would count twice; trainer.lora.sync=merged"),
])
def test_a_bad_init_from_is_one_clear_error(recipe, sft_run, tmp_path, where, overrides, why):
    (tmp_path / "empty").mkdir()
    src = sft_run if where == "sft" else tmp_path / where
    with pytest.raises(ConfigError, match=f"model.init_from.*{why}" if where != "sft" else why):
        load(recipe, [f"model.init_from={src}", *overrides])
