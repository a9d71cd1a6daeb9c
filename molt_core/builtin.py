"""Built-in plugin: the core's own engine and trainer backend, registered like any plugin."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_engines() -> dict[str, type]:
    from molt_core.engines.hf import HFEngine
    return {"hf": HFEngine}


@hookimpl
def molt_trainer_backends() -> dict[str, type]:
    from molt_core.policy import Policy
    return {"fsdp2": Policy}
