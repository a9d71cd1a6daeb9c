"""Engine restarts: a dead engine actor is replaced and loaded with the trainer's weights."""

from __future__ import annotations

from typing import Any, Callable

import ray
import structlog

from molt_core.config import Config
from molt_core.run.cluster import spawn_engine

__all__ = ["EngineDiedError", "EngineRestarts"]

log = structlog.get_logger("molt.cluster")


class EngineDiedError(RuntimeError):
    """An engine actor died and `engine.max_restarts` replacements are used up."""


class EngineRestarts:
    """Replaces dead engine actors (same options), loaded with the trainer's current weights and
    version (`push(engines)`), `engine.max_restarts` times per run (`faults/engine_restarts`):
    while the driver waits for rollouts, and when the push after a train step meets one."""

    def __init__(self, cfg: Config, plugins: Any, generator: Any, push: Callable) -> None:
        self.cfg, self.plugins, self.gen, self.push = cfg, plugins, generator, push
        self.engines = generator.client.engines        # the run's list: replaced in place
        generator.revive, generator.client.reissue = self.revive, True
        generator.counters.setdefault("faults/engine_restarts", 0)

    def revive(self, dead: dict[int, str], push_all: bool = False) -> None:
        """Replace engines `dead` ({index: cause}), push them (`push_all`: all) the weights."""
        for i, cause in sorted(dead.items()):
            n = self.gen.counters["faults/engine_restarts"]
            if n >= self.cfg.engine.max_restarts:
                raise EngineDiedError(
                    f"engine {i} ({self.engines[i]}) died: {cause}; engine.max_restarts={n} "
                    "replacements are used up: raise it (a resumed run may) or see the engine's "
                    "log for why it dies")
            self.gen.counters["faults/engine_restarts"] = n + 1
            log.warning("engine_restart", engine=i, cause=cause, restarts=n + 1)
            self.engines[i] = spawn_engine(self.cfg, self.plugins, i, f"-r{n + 1}")
        ray.get([self.engines[i].get_version.remote() for i in dead],    # loaded: as at start
                timeout=self.cfg.engine.timeout_s)
        self.push(self.engines if push_all else [self.engines[i] for i in dead])
        for i in dead:
            self.gen.client.dead.pop(i, None)
        self.gen.release_requests()

    def after_train(self, scheme: Any, step: int) -> int:
        """`scheme.after_train(step)`; if its push met a dead engine, that one is replaced and the
        push of `scheme.version` redone to every engine, requests held."""
        from molt_core.weight_sync import WeightSyncError   # imports torch: not before prestart
        try:
            return scheme.after_train(step)
        except (WeightSyncError, ray.exceptions.RayActorError):
            dead = dict(self.gen.client.dead)
            for i, e in enumerate(self.engines):
                try:
                    ray.get(e.get_version.remote(), timeout=self.cfg.engine.timeout_s)
                except ray.exceptions.RayActorError as err:
                    dead[i] = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            if not dead:
                raise
        self.gen.hold_requests()         # released by revive (left held if it fails: run over)
        self.revive(dead, push_all=True)
        return scheme.version
