"""Exports of a trained policy that are not part of the training path, and `molt export
CHECKPOINT OUT`: a Molt checkpoint (or a run dir: its latest) as a plain HF directory
(safetensors, config, tokenizer, chat template, generation config; `molt_core.run.checkpoint`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from molt_core import lora

__all__ = ["add_args", "export_lora", "main"]


def export_lora(policy: Any, model_path: str, out_dir: str | Path) -> Path:
    """A merged HF directory at `out_dir` (config, tokenizer, safetensors) and the PEFT adapter
    in `out_dir/adapter` (for `PeftModel.from_pretrained(base, ...)`)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    (out / "adapter").mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(model_path).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(model_path).save_pretrained(out)
    except OSError:
        pass                            # the model has none
    save_file({k: v.contiguous() for k, v in policy.full_params().items()},
              out / "model.safetensors", metadata={"format": "pt"})
    save_file(policy.full_params(adapter=True), out / "adapter" / "adapter_model.safetensors",
              metadata={"format": "pt"})
    lora.peft_config(asdict(policy.cfg.lora), str(model_path)).save_pretrained(out / "adapter")
    return out


def add_args(p: Any) -> None:
    p.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_N, or a run dir (its latest)")
    p.add_argument("out", help="output directory (replaced if it exists)")


def main(args: Any) -> int:
    from molt_core.run.checkpoint import export
    print(export(args.checkpoint, args.out))
    return 0
