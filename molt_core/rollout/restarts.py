"""Engine restarts: a dead engine actor is replaced and loaded with the trainer's weights. The
trainer hands `EngineRestarts` to the scheme as its `policy`, so a push that meets a dead engine
is redone under the conditions the scheme pushed under (requests held, engines paused)."""

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
    """Replaces dead engine actors (same options), `engine.max_restarts` times per run
    (`faults/engine_restarts`): while the driver waits for rollouts (loaded with `version()`),
    and when a push meets one."""

    def __init__(self, cfg: Config, plugins: Any, generator: Any, policy: Any,
                 version: Callable[[], int]) -> None:
        self.cfg, self.plugins, self.gen, self.policy = cfg, plugins, generator, policy
        self.engines = generator.client.engines        # the run's list: replaced in place
        generator.on_engine_death(lambda dead: self.revive(dead, version()))
        generator.counters.setdefault("faults/engine_restarts", 0)

    def __getattr__(self, name: str) -> Any:    # the rest of what a scheme asks of its policy
        return getattr(self.policy, name)

    def push_weights(self, engines: list[Any], version: int) -> Any:
        from molt_core.weight_sync import WeightSyncError   # imports torch: not before prestart
        try:
            return self.policy.push_weights(engines, version)
        except (WeightSyncError, ray.exceptions.RayActorError):
            dead = dict(self.gen.client.dead)
            for i, e in enumerate(self.engines):
                try:
                    ray.get(e.get_version.remote(), timeout=self.cfg.engine.timeout_s)
                except ray.exceptions.RayActorError as err:
                    dead[i] = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            if not dead:
                raise
        self.revive(dead, version, push_all=True)

    def revive(self, dead: dict[int, str], version: int, push_all: bool = False) -> None:
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
        self.policy.push_weights(self.engines if push_all else [self.engines[i] for i in dead],
                                 version)
        for i in dead:
            self.gen.client.dead.pop(i, None)
        self.gen.release_requests()
