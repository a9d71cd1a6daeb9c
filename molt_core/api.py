"""The Python API, also as `molt_core.train` etc.: what `molt run`, `molt eval` and `molt export`
do, from a script or a notebook cell. A recipe is a YAML path, a dict or a `Config`; overrides
are `key=value` strings or a {key: value} dict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from molt_core.cli import load, start
from molt_core.config import Config, to_dict

__all__ = ["Run", "evaluate", "load_recipe", "train"]


class Run(NamedTuple):
    run_dir: Path
    history: list[dict[str, Any]]       # metrics.jsonl's rows: one per step, and `eval/...` rows


def _recipe(recipe: Any, overrides: Any) -> tuple[str | None, list[str]]:
    """A path and overrides; a dict or Config becomes overrides of its top-level sections."""
    extra = [f"{k}={json.dumps(v, default=str)}" for k, v in overrides.items()] \
        if isinstance(overrides, dict) else list(overrides)
    if isinstance(recipe, Config):
        recipe = to_dict(recipe)
        recipe.update(recipe.pop("plugins") or {})
    if isinstance(recipe, dict):
        return None, [f"{k}={json.dumps(v, default=str)}" for k, v in recipe.items()] + extra
    return (None if recipe is None else str(recipe)), extra


def load_recipe(recipe: Any, overrides: Any = (), *, plugins: list[str] = ()) -> Config:
    """The recipe's config, checked against the plugins (as `molt validate` does)."""
    return load(*_recipe(recipe, overrides), list(plugins))[0]


def train(recipe: Any = None, overrides: Any = (), *, plugins: list[str] = (),
          blocked: list[str] = (), resume: str | Path | None = None, progress: bool = False
          ) -> Run:
    """`molt run RECIPE [overrides] [--plugin ...] [--resume RUN_DIR]`."""
    run_dir, history = start(*_recipe(recipe, overrides), list(plugins), list(blocked),
                             progress=progress,
                             resume=None if resume is None else str(resume),
                             argv=["molt_core.train"])
    return Run(run_dir, history)


def evaluate(model: str | Path, recipe: Any, overrides: Any = (), *, plugins: list[str] = (),
             blocked: list[str] = ()) -> dict[str, float]:
    """`molt eval MODEL RECIPE`: the recipe's held-out metrics (`eval/...`) of an HF directory,
    a PEFT adapter, a Molt checkpoint or a run directory (its latest checkpoint)."""
    import tempfile

    from transformers import AutoConfig, AutoTokenizer

    from molt_core.rollout.eval import evaluate as held_out
    from molt_core.run import cluster
    from molt_tools.evaluate import model_dir

    with tempfile.TemporaryDirectory(prefix="molt-eval-") as scratch:
        path = model_dir(str(model), Path(scratch))
        recipe, extra = _recipe(recipe, overrides)
        cfg, plugs = load(recipe, [*extra, f"model.path={path}"], list(plugins), list(blocked))
        vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
        tokenizer = AutoTokenizer.from_pretrained(path)
        with cluster.start(cfg, plugs, trainer=False) as (_, engines):
            return held_out(cfg, plugs, engines, tokenizer, vocab)
