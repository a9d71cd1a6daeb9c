"""Asynchronous rollout: groups from the generator's streaming pool within `rollout.max_staleness`
while the trainer trains; weights are pushed at a request boundary, so a response never mixes
versions (docs/scaling.md, "Rollout schemes and overlap"; `rollout.deterministic` there too)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from molt_core import hookimpl
from molt_core.config import Config, ConfigError

if TYPE_CHECKING:
    from molt_core.trajectory import Trajectory

__all__ = ["AsyncScheme", "configure"]


class AsyncScheme:
    split = False                              # deterministic: calls stop at a split (partial)

    def __init__(self, cfg: Any, generator: Any, weights: Any, engines: list[Any]) -> None:
        self.cfg, self.generator, self.weights, self.engines = cfg, generator, weights, engines
        self.version = 0                       # the weights the trainer trains next
        r = cfg.rollout
        self.pool_size = r.groups_per_step * (r.max_staleness + 1) if r.deterministic else \
            r.max_inflight_groups or r.groups_per_step
        self.started = False

    def next_batch(self, step: int) -> list[list[Trajectory]]:
        return self.refill(self.cfg.rollout.groups_per_step)

    def refill(self, n: int) -> list[list[Trajectory]]:
        """n finished groups within the staleness bound (also a batch filter's `refill`); n may
        exceed the pool: it is taken in pool-sized parts as the pool refills."""
        from molt_core.rollout.generator import filter_stale
        r = self.cfg.rollout
        if r.deterministic:          # batches start here (after a push), so none is running
            self.generator.advance(self.version, r.groups_per_step, r.max_staleness, self.split)
        elif not self.started:       # here, not in __init__: after a resume's restore
            self.started = True
            self.generator.start_pool(self.pool_size)
        out: list[list[Trajectory]] = []
        while len(out) < n:
            groups = self.generator.take(min(n - len(out), self.pool_size))
            out += filter_stale(groups, self.version, r.max_staleness, r.stale,
                                self.generator.counters)
        return out

    def sync_weights(self, step: int) -> int:
        self.version += 1
        if self.cfg.rollout.deterministic:
            self.generator.drain()
            self.weights.push(self.version)
            return self.version
        self.generator.hold_requests()
        try:
            self.weights.push(self.version)
        finally:
            self.generator.release_requests()
        return self.version


def configure(cfg: Config, scheme: str) -> None:
    """With `rollout.scheme` `scheme` (a pooled one): a correction is required, and an unset
    `rollout.max_staleness` becomes the pool's depth in batches."""
    r = cfg.rollout
    if r.scheme != scheme:
        return
    if cfg.algorithm.correction == "none":
        raise ConfigError(
            f"rollout.scheme '{scheme}' trains on tokens sampled by older weights (up to "
            f"rollout.max_staleness versions) than the ones being "
            "trained; without an importance-sampling correction the update is biased. Set "
            "algorithm.correction to tis, icepop or mis (thresholds in algorithm.correction_args)")
    depth = -(-(r.max_inflight_groups or r.groups_per_step) // r.groups_per_step)
    if r.max_staleness is None:
        r.max_staleness = depth
    elif r.max_staleness == 0:
        raise ConfigError(
            f"rollout.max_staleness=0 with rollout.scheme={scheme}: the pool generates the next "
            "batch while the trainer steps, so every pooled group is at least one version old "
            f"and would be {'dropped' if r.stale == 'drop' else 'masked'}. Leave it unset "
            f"(here: {depth}, the pool's depth in batches), set it >= 1, or use "
            "rollout.scheme=sync for strictly on-policy batches")


@hookimpl
def molt_configure(cfg: Config) -> None:
    configure(cfg, "async")


@hookimpl
def molt_rollout_schemes() -> dict:
    return {"async": AsyncScheme}
