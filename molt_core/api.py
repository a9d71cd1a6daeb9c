"""`molt_core.train` and `load_recipe`: `molt run` and `molt validate` from a script or notebook.
A recipe is a YAML path, a dict or a `Config`; overrides `key=value` strings or a dict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from molt_core.cli import load, start
from molt_core.config import Config, to_dict

__all__ = ["Run", "load_recipe", "recipe_args", "sft", "train"]


class Run(NamedTuple):
    run_dir: Path
    history: list[dict[str, Any]]       # metrics.jsonl's rows: one per step, and `eval/...` rows


def _as_args(d: dict, prefix: str = "") -> list[str]:
    """`key=value` strings (JSON: YAML reads it); a nested non-empty dict merges key by key,
    as dotted keys do, instead of replacing the whole section (unless a key holds a dot or an
    `=`, e.g. a reward `./r.py:f`: that dict is one value)."""
    return [a for k, v in d.items() for a in (
        _as_args(v, f"{prefix}{k}.") if isinstance(v, dict) and v and not any(
            "." in str(j) or "=" in str(j) for j in v)
        else [f"{prefix}{k}={json.dumps(v, default=str)}"])]


def recipe_args(recipe: Any, overrides: Any = ()) -> tuple[str | None, list[str]]:
    """A recipe path and `key=value` overrides; a dict or Config: overrides of its sections."""
    if isinstance(recipe, Config):
        recipe = to_dict(recipe)
        recipe.update(recipe.pop("plugins"))
    extra = _as_args(overrides) if isinstance(overrides, dict) else list(overrides)
    if isinstance(recipe, dict):
        return None, _as_args(recipe) + extra
    return (None if recipe is None else str(recipe)), extra


def load_recipe(recipe: Any, overrides: Any = (), *, plugins: list[str] = ()) -> Config:
    """The recipe's config, checked against the plugins (`molt validate`)."""
    return load(*recipe_args(recipe, overrides), list(plugins))[0]


def train(recipe: Any = None, overrides: Any = (), *, plugins: list[str] = (),
          resume: str | Path | None = None, progress: bool = False) -> Run:
    """`molt run RECIPE [overrides] [--plugin ...] [--resume RUN_DIR]`."""
    return Run(*start(*recipe_args(recipe, overrides), list(plugins), progress=progress,
                      resume=resume and str(resume), argv=["molt_core.train"]))


def sft(recipe: Any = None, overrides: Any = (), *, plugins: list[str] = (),
        progress: bool = False) -> Run:
    """`molt sft RECIPE [overrides] [--plugin ...]`: its run dir (the model: `final/`) and rows."""
    from molt_core.sft_trainer import start as start_sft
    return Run(*start_sft(*recipe_args(recipe, overrides), list(plugins), progress=progress,
                          argv=["molt_core.sft"]))
