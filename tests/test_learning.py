"""Learning tests: CPU recipes' mean reward rises from chance to well above it (~1.5-2 min each)."""

from __future__ import annotations

import pytest
import yaml

from molt_core.cli import load
from molt_core.trainer import train


def run_recipe(recipe: str, model_dir, tmp_path, steps: int, last: int = 20) -> tuple[float, float]:
    data = yaml.safe_load(open(recipe))
    data["model"]["path"] = str(model_dir)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg, plugins = load(str(path), [f"trainer.steps={steps}"])
    history = train(cfg, plugins, tmp_path, progress=False)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == steps
    start = sum(h["reward/mean"] for h in history[:5]) / 5
    end = sum(h["reward/mean"] for h in history[-last:]) / last
    print(f"{recipe}: mean reward first 5 steps {start:.3f}, last {last} steps {end:.3f}")
    return start, end


@pytest.mark.slow
def test_next_letter_learns(ray_local, tiny_chars_dir, tmp_path):
    start, end = run_recipe("recipes/cpu/next_letter.yaml", tiny_chars_dir, tmp_path, 220)
    assert start <= 0.2
    assert end >= 0.7


@pytest.mark.slow
def test_multi_turn_guess_number_learns(ray_local, tiny_chars_dir, tmp_path):
    """Three turns with masked "higher"/"lower" feedback between the policy's guesses."""
    start, end = run_recipe("recipes/cpu/guess_number.yaml", tiny_chars_dir, tmp_path, 80)
    assert start <= 0.15
    assert end >= 0.3


@pytest.mark.slow
def test_vl_colour_learns(ray_local, tiny_vl_dir, tmp_path):
    """Tiny Qwen3-VL names the colour of an image (forward consistency checked every 5 steps)."""
    start, end = run_recipe("recipes/cpu/vl_colour.yaml", tiny_vl_dir, tmp_path, 60)
    assert start <= 0.15
    assert end >= 0.6


@pytest.fixture(scope="session")
def calculator_dir(tmp_path_factory):
    """The chat recipe's policy, built here: tiny Qwen3 + short SFT (~1 min CPU)."""
    from molt_tools.calculator_model import build_model

    return build_model(tmp_path_factory.mktemp("calculator") / "model")


@pytest.mark.slow
def test_chat_tool_use_learns(ray_local, calculator_dir, tmp_path):
    """A chat agent on the stock OpenAI SDK learns to call the calculator tool to answer."""
    start, end = run_recipe("recipes/cpu/chat_calculator.yaml", calculator_dir, tmp_path, 15,
                            last=10)
    assert start <= 0.45
    assert end >= start + 0.25
