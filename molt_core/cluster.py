"""Ray placement: start (or join) Ray, start trainer ranks and rollout engines, clean up."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

import ray
import structlog

from molt_core.config import Config

__all__ = ["init_ray", "start"]

log = structlog.get_logger("molt.cluster")


def init_ray(cfg: Config) -> bool:
    """Connect to `ray.address` or start a local Ray; returns True if this call started it."""
    if ray.is_initialized():
        return False
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=True)
        return False
    os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "molt-ray"))
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
    ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), include_dashboard=False,
             _temp_dir=os.environ["RAY_TMPDIR"], log_to_driver=True)
    return True


@contextmanager
def start(cfg: Config, plugins: Any) -> Iterator[tuple[Any, list[Any]]]:
    """Yield `(policy, engines)`; everything started here is stopped on exit."""
    started = init_ray(cfg)
    engine_cls = ray.remote(plugins.get("engine", cfg.engine.name))
    backend = plugins.get("trainer_backend", cfg.trainer.backend)
    engines, policy = [], None
    try:
        engines = [engine_cls.options(num_cpus=cfg.engine.cpus_per_engine,
                                      name=f"molt-engine-{i}-{os.getpid()}").remote(
                       cfg.model.path, dtype=cfg.model.dtype,
                       max_batch_size=cfg.engine.max_batch_size, seed=cfg.seed + 1000 * i)
                   for i in range(cfg.engine.num_engines)]
        policy = backend(cfg.model.path, cfg.trainer, dtype=cfg.model.dtype, seed=cfg.seed)
        ray.get([e.get_version.remote() for e in engines], timeout=cfg.engine.timeout_s)
        log.info("cluster_ready", engines=len(engines), trainer_ranks=cfg.trainer.num_ranks)
        yield policy, engines
    finally:
        if policy is not None:
            policy.shutdown()
        for e in engines:
            ray.kill(e)
        if started:
            ray.shutdown()
