"""`molt eval MODEL_OR_CHECKPOINT RECIPE [key=value ...]`: the recipe's held-out evaluation
(`molt_core.rollout.eval`) on a model, with engines only (no trainer).

MODEL_OR_CHECKPOINT: an HF directory (e.g. `molt pretrained` or an export), a PEFT LoRA adapter
directory (merged into its base model first), or a Molt checkpoint (exported first).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_args", "main", "model_dir"]


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


def main(args: Any) -> int:
    from molt_core.api import evaluate

    try:
        metrics = evaluate(args.model, args.recipe, args.overrides, plugins=args.plugin,
                           blocked=args.blocked)
    except (FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"model": args.model, "recipe": args.recipe, **metrics}, indent=1))
    return 0
