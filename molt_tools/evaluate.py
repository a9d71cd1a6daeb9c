"""`molt eval MODEL_OR_CHECKPOINT RECIPE [key=value ...]`: the recipe's held-out evaluation
(`molt_core.rollout.eval`) on a model, with engines only (no trainer).

MODEL_OR_CHECKPOINT: an HF directory (e.g. `molt pretrained` or an export), a PEFT LoRA adapter
directory (merged into its base model first), or a Molt checkpoint (exported first).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["add_args", "evaluate", "main", "model_dir"]


def add_args(p: Any) -> None:
    from molt_core.cli import recipe_args
    p.add_argument("model", help="HF model dir, PEFT adapter dir, or Molt checkpoint")
    recipe_args(p)


def model_dir(path: str, scratch: Path) -> Path:
    """An HF directory for `path` (adapters merged, checkpoints exported into `scratch`)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if (p / "adapter_config.json").is_file():
        from peft import PeftConfig, PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = PeftConfig.from_pretrained(p).base_model_name_or_path
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), p)
        model.merge_and_unload().save_pretrained(scratch)
        AutoTokenizer.from_pretrained(base).save_pretrained(scratch)
        return scratch
    if (p / "meta.json").is_file() or (p / "checkpoints").is_dir():
        from molt_core.run import checkpoint   # type: ignore[attr-defined]
        return Path(checkpoint.export(p, scratch / "model"))
    raise FileNotFoundError(f"{path}: not an HF model directory (config.json), a PEFT adapter "
                            "(adapter_config.json) or a Molt checkpoint")


def evaluate(model: str | Path, recipe: Any, overrides: Any = (), *, plugins: list[str] = (),
             blocked: list[str] = (), progress: Any = lambda line: None) -> dict[str, float]:
    """`molt_core.evaluate`: the recipe's held-out metrics (`eval/...`) of `model` (an HF or PEFT
    directory, a Molt checkpoint or run directory); recipe and overrides as `molt_core.train`'s.
    `progress` gets "eval: 12/64 rollouts" as each group finishes."""
    from transformers import AutoConfig

    from molt_core.api import recipe_args
    from molt_core.cli import load
    from molt_core.multimodal import load_tokenizer
    from molt_core.rollout.eval import evaluate as held_out
    from molt_core.run import cluster

    with tempfile.TemporaryDirectory(prefix="molt-eval-") as scratch:
        path = model_dir(str(model), Path(scratch))
        recipe, extra = recipe_args(recipe, overrides)
        cfg, plugs = load(recipe, [*extra, f"model.path={path}"], list(plugins), list(blocked))
        tok = load_tokenizer(path, cfg.model.chat_template)
        vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
        with cluster.start(cfg, plugs, trainer=False) as (_, engines):
            return held_out(cfg, plugs, engines, tok, vocab, progress)


def main(args: Any) -> int:
    try:
        metrics = evaluate(args.model, args.recipe, args.overrides, plugins=args.plugin,
                           blocked=args.blocked, progress=_progress)
    except (FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _progress("\n")
    print(json.dumps({"model": args.model, "recipe": args.recipe, **metrics}, indent=1))
    return 0


def _progress(line: str) -> None:
    """On a terminal, one line rewritten in place (stderr: stdout is the JSON result)."""
    if sys.stderr.isatty():
        print(line if line == "\n" else f"\r{line}", end="", file=sys.stderr, flush=True)
