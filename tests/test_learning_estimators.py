"""Each shipped estimator/loss plugin trains the CPU toy recipe clearly above its start."""

from __future__ import annotations

import pytest

from molt_core.cli import load
from molt_core.trainer import train


@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["dapo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "cispo", "ppo"])
def test_estimator_learns_toy(ray_local, tiny_chars_dir, tmp_path, plugin):
    # PPO runs its own recipe: groups of one, the critic is the baseline
    recipe = f"recipes/cpu/next_letter{'_ppo' if plugin == 'ppo' else ''}.yaml"
    cfg, plugins = load(recipe,
                        [f"model.path={tiny_chars_dir}", "trainer.steps=150"], [plugin])
    history = train(cfg, plugins, None, progress=False)
    start = sum(h["reward/mean"] for h in history[:5]) / 5
    end = sum(h["reward/mean"] for h in history[-15:]) / 15
    print(f"{plugin} ({cfg.algorithm.estimator}/{cfg.algorithm.loss}): {start:.3f} -> {end:.3f}")
    assert start <= 0.2
    assert end >= start + 0.3
