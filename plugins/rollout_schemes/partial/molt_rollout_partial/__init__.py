"""Partial rollout: at a weight sync the engines pause their in-flight requests, load the new
weights and resume them; no request is dropped or restarted.

Like `molt-rollout-async` (streaming pool, staleness bound, correction required), but the push
does not wait for requests to finish: a response that spans the sync carries both versions, each
token stamped with the weights that sampled it and its behavior log-prob under those weights (the
engine recomputes the KV cache of in-flight requests after an update).

With `rollout.deterministic` the split is fixed instead (`Generator.advance`): each engine call of
batch i samples half its max_new_tokens with version max(0, i - max_staleness) and the rest with
the next one; the push waits until every rollout of the batch finished or stopped at its split.
"""

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
            self.push()             # a dead engine is replaced there, the push redone
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
