"""Partial rollout: `molt-rollout-async`, but at a weight sync the engines pause their in-flight
requests, load the new weights and resume them, so a response may carry two versions, each token
stamped with its own (docs/scaling.md, "Rollout schemes and overlap"; `rollout.deterministic`)."""

from __future__ import annotations

import contextlib

from molt_core import hookimpl
from molt_core.config import Config
from molt_rollout_async import AsyncScheme, configure

__all__ = ["PartialScheme"]


class PartialScheme(AsyncScheme):
    split = True

    def sync_weights(self, step: int) -> int:
        if self.cfg.rollout.deterministic:
            return super().sync_weights(step)
        self.version += 1
        try:       # the pause inside: an engine that died must not leave the others paused
            self._each("pause")
            self.weights.push(self.version)   # a dead engine is replaced there, the push redone
        finally:
            self._each("resume")
        return self.version

    def _each(self, method: str) -> None:      # a dead engine is left to the push to replace
        import ray

        from molt_core.run import actors
        for ref in [getattr(e, method).remote() for e in self.engines]:
            with contextlib.suppress(ray.exceptions.RayActorError):
                actors.get(ref, timeout=self.cfg.trainer.weight_sync_timeout_s)


@hookimpl
def molt_configure(cfg: Config) -> None:
    configure(cfg, "partial")


@hookimpl
def molt_rollout_schemes() -> dict:
    return {"partial": PartialScheme}
