"""Strictly on-policy rollout: generate a batch, train on it, push weights, repeat."""

from __future__ import annotations

from typing import Any

from molt_core import hookimpl
from molt_core.trajectory import Trajectory

__all__ = ["SyncScheme"]


class SyncScheme:
    def __init__(self, cfg: Any, generator: Any, weights: Any, engines: list[Any]) -> None:
        self.cfg, self.generator, self.weights = cfg, generator, weights
        self.version = 0

    def next_batch(self, step: int) -> list[list[Trajectory]]:
        return self.generator.generate(self.cfg.rollout.groups_per_step)

    def sync_weights(self, step: int) -> int:
        self.version += 1
        self.weights.push(self.version)
        return self.version


@hookimpl
def molt_rollout_schemes() -> dict:
    return {"sync": SyncScheme}
