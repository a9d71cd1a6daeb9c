"""Learning test: the CPU recipe's mean reward rises from chance to well above it (~2-3 min)."""

from __future__ import annotations

import pytest
import yaml

from molt_core.cli import load
from molt_core.trainer import train


@pytest.mark.slow
def test_cpu_recipe_learns(ray_local, tiny_chars_dir, tmp_path):
    data = yaml.safe_load(open("recipes/cpu/next_letter.yaml"))
    data["model"]["path"] = str(tiny_chars_dir)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    cfg, plugins = load(str(recipe), ["trainer.steps=220"])
    history = train(cfg, plugins, tmp_path, progress=False)
    start = sum(h["reward/mean"] for h in history[:5]) / 5
    end = sum(h["reward/mean"] for h in history[-20:]) / 20
    print(f"mean reward: first 5 steps {start:.3f}, last 20 steps {end:.3f}")
    assert start <= 0.2
    assert end >= 0.7
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 220
