"""The shipped algorithm plugins: `--plugin NAME` selects them, and their recipes validate."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from molt_core.cli import load
from molt_core.config import ConfigError

RECIPES = Path(__file__).parents[1] / "recipes" / "cpu"


@pytest.mark.parametrize("plugin, estimator, loss", [
    ("dapo", "dapo", "dapo"),
    ("dr_grpo", "dr_grpo", "ppo_clip"),
    ("rloo", "rloo", "ppo_clip"),
    ("reinforce_pp", "reinforce_pp", "ppo_clip"),
    ("turn_rloo", "turn_rloo", "ppo_clip"),
    ("gigpo", "gigpo", "ppo_clip"),
    ("gspo", "grpo", "gspo"),
    ("cispo", "grpo", "cispo"),
])
def test_plugin_selects_its_estimator_and_loss(tiny_recipe, plugin, estimator, loss):
    cfg, plugins = load(tiny_recipe, [], [plugin])
    assert (cfg.algorithm.estimator, cfg.algorithm.loss) == (estimator, loss)
    assert plugins.info[plugin]["distribution"] == f"molt-estimator-{plugin.replace('_', '-')}"


@pytest.mark.parametrize("name", ["gspo", "cispo", "dapo"])
def test_algorithm_recipes_validate(tmp_path, tiny_model_dir, name):
    data = yaml.safe_load((RECIPES / f"next_letter_{name}.yaml").read_text())
    base = yaml.safe_load((RECIPES / "next_letter.yaml").read_text())
    # copies of the toy recipe: only the algorithm (and DAPO's own section) differ
    assert {k: v for k, v in data.items() if k not in ("algorithm", "dapo", "name")} == \
        {k: v for k, v in base.items() if k not in ("algorithm", "name")}
    data["model"]["path"] = str(tiny_model_dir)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg, _ = load(str(path), [])
    assert name in (cfg.algorithm.estimator, cfg.algorithm.loss)


def test_dapo_options_are_a_checked_config_section(tiny_recipe):
    four = "sampling.max_new_tokens=4"
    cfg, _ = load(tiny_recipe, [four, "dapo.overlong_buffer=2"], ["dapo"])
    assert cfg.plugins["dapo"].overlong_buffer == 2
    with pytest.raises(ConfigError, match="unknown config key 'dapo.buffer'"):
        load(tiny_recipe, ["dapo.buffer=2"], ["dapo"])
    with pytest.raises(ConfigError, match="overlong_buffer"):
        load(tiny_recipe, [four, "dapo.overlong_buffer=4"], ["dapo"])     # = max_new_tokens
