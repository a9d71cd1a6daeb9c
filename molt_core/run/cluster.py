"""Ray placement: start (or join) Ray, start trainer ranks and rollout engines (one Ray actor each,
or in the driver: `embedded`), clean up; what each reserves: docs/scaling.md, "Roles and what they
reserve" (`actor_options`, checked before anything starts by `check_resources`)."""

from __future__ import annotations

import datetime
import gc
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager, suppress
from typing import Any, Iterator

import ray
import structlog

from molt_core.config import Config, ConfigError, load_config
from molt_core.run import actors

__all__ = ["actor_options", "check_resources", "embedded", "engine_kwargs", "engine_name",
           "init_ray", "local_node", "num_threads", "prestart", "rank_placement", "reserved",
           "spawn_engine", "start"]

log = structlog.get_logger("molt.cluster")
_early: dict[str, threading.Event] = {}     # "up": set once prestart's ray.init has returned
_reapers: list[subprocess.Popen] = []       # one per local Ray this process started
_starts = [0]                               # `start`s in this process (engine names)
# Once the driver is gone (its end of the pipe closed: exit, or kill -9), whatever of its Ray
# session still runs is killed (agents outlived a killed driver) and the session folder removed.
_REAP = """import contextlib, os, shutil, sys
sys.stdin.read()
session = sys.argv[1]
for pid in {int(p) for p in os.listdir("/proc") if p.isdigit()} - {os.getpid()}:
    with contextlib.suppress(OSError):
        if session.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
            os.kill(pid, 9)
shutil.rmtree(session, ignore_errors=True)
latest = os.path.join(os.path.dirname(session), "session_latest")
if not os.path.exists(latest) and os.path.islink(latest):
    os.unlink(latest)
"""


@contextmanager
def prestart(recipe: str, overrides: list[str]) -> Iterator[None]:
    """Inside, `recipe`'s local Ray starts in a thread while the driver imports torch,
    transformers and the plugins (seconds each); `init_ray` takes it, an error stops it. Not with
    `ray.address`, plugin config sections (unread before the plugins load) or torch imported."""
    cfg = None
    with suppress(ConfigError):
        cfg = load_config(recipe, overrides)
    if cfg and not (cfg.ray.address or ray.is_initialized() or _early or "torch" in sys.modules
                    or embedded(cfg, trainer=True, cuda=False)):
        _early["up"] = threading.Event()
        threading.Thread(target=_start_local, args=(cfg, _early["up"]), daemon=True).start()
    try:
        yield
    except BaseException:           # no run, no Ray
        if _early:
            _early.pop("up").wait()
            _shutdown()
        raise


def embedded(cfg: Config, trainer: bool, cuda: bool) -> bool:
    """Whether the run goes without Ray (`ray.embedded`): the engine on a thread of the driver
    (`actors.LocalActor`), the trainer rank in the driver (`trainer.in_driver`)."""
    if cfg.ray.embedded != "auto":
        return cfg.ray.embedded == "on"
    t, e = cfg.trainer, cfg.engine
    ranks_ok = not trainer or (t.in_driver and t.num_ranks == 1 and t.backend == "fsdp2"
                               and t.gpus_per_rank <= 0 and not (t.cpus_per_rank or t.resources))
    return (ranks_ok and not cfg.ray.address and not cuda and e.name == "hf" and e.num_engines == 1
            and e.gpus_per_engine <= 0 and not (e.cpus_per_engine or e.resources))


def init_ray(cfg: Config) -> bool:
    """Connect to `ray.address` or start a local Ray (or take `prestart`'s): True if started."""
    if early := _early.pop("up", None):
        early.wait()
    if ray.is_initialized():
        return bool(early)
    if cfg.ray.address:    # quiet console: no weight-loading bar per actor
        ray.init(address=cfg.ray.address,
                 runtime_env={"env_vars": {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}})
        return False
    _start_local(cfg)
    return True


def _start_local(cfg: Config, up: threading.Event | None = None) -> None:
    # inherited by the workers: unlike a runtime_env, leaves those started ahead usable (~1 s)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("RAY_worker_niceness", "0")   # Ray's default 15 starves the actors
    os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "molt-ray"))
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
    for name in ("ray._private.authentication.authentication_token_setup", "ray._private.worker"):
        logging.getLogger(name).addFilter(lambda r: not r.getMessage().startswith(
            ("Token authentication is enabled for this", "SIGTERM handler is not set")))
    try:
        ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), include_dashboard=False,
                 _temp_dir=os.environ["RAY_TMPDIR"], logging_level=logging.WARNING)
        session = ray._private.worker._global_node.get_session_dir_path()
        _reapers.append(subprocess.Popen([sys.executable, "-c", _REAP, session],
                                         stdin=subprocess.PIPE, start_new_session=True))
    finally:
        if up:      # prestart's thread (a failure: init_ray retries and raises it)
            up.set()
    if up:          # Ray's daemons die with the thread that started them
        threading.Event().wait()


def _shutdown() -> None:
    ray.shutdown()
    while _reapers:
        _reapers.pop().stdin.close()


def actor_options(cfg: Config, has_gpus: bool) -> tuple[dict, dict]:
    """Ray options of one trainer rank and of one engine (-1 GPUs: one per rank and
    `engine.tensor_parallel_size` per engine when the cluster has GPUs, else none)."""
    t, e = cfg.trainer, cfg.engine
    rank_gpus = t.gpus_per_rank if t.gpus_per_rank >= 0 else float(has_gpus)
    engine_gpus = (e.gpus_per_engine if e.gpus_per_engine >= 0
                   else float(e.tensor_parallel_size) * has_gpus)
    return ({"num_cpus": t.cpus_per_rank, "num_gpus": rank_gpus, "resources": dict(t.resources)},
            {"num_cpus": e.cpus_per_engine, "num_gpus": engine_gpus, "resources": dict(e.resources)})


def num_threads(cfg: Config, cores: int) -> tuple[int, int]:
    """Intra-op threads of one trainer rank and of one engine: the CPUs it reserves, or, reserving
    none, a share of a node's `cores`: under `sync` engine and trainer alternate, so each role
    gets the whole node in its phase; other schemes overlap them, so all actors split it."""
    t, e = cfg.trainer, cfg.engine
    actors = (t.num_ranks, e.num_engines) if cfg.rollout.scheme == "sync" else (
        t.num_ranks + e.num_engines,) * 2
    return (max(1, math.ceil(t.cpus_per_rank) or cores // actors[0]),
            max(1, math.ceil(e.cpus_per_engine) or cores // actors[1]))


def engine_kwargs(cfg: Config, index: int) -> dict[str, Any]:
    """Keyword arguments of engine `index`'s constructor (after the model path)."""
    e = cfg.engine
    kwargs = {**e.args, "dtype": cfg.model.dtype, "max_batch_size": e.max_batch_size,
              "seed": cfg.seed + 1000 * index}
    if e.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = e.tensor_parallel_size
    if e.speculative:          # vLLM's speculative_config, passed through as is
        kwargs["engine_kwargs"] = {**kwargs.get("engine_kwargs", {}),
                                   "speculative_config": dict(e.speculative)}
    return kwargs


def engine_name(index: int) -> str:
    """Ray name of engine `index` of the latest `start` (unique: a killed actor's name lingers)."""
    return f"molt-engine-{index}-{os.getpid()}-{_starts[0]}"


def spawn_engine(cfg: Config, plugins: Any, index: int, suffix: str = "",
                 local: bool = False) -> Any:
    """Engine actor `index`; `suffix` names a dead one's replacement, `local`: a `LocalActor`."""
    cls = plugins.get("engine", cfg.engine.name)
    if local:
        threads = num_threads(cfg, cfg.ray.num_cpus or os.cpu_count() or 1)[1]
        return actors.LocalActor(cls, cfg.model.path, name=f"engine-{index}{suffix}",
                                 **{"num_threads": threads, **engine_kwargs(cfg, index)})
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    threads = num_threads(cfg, int(min(n.get("CPU", 1) for n in nodes)))[1]
    opts = actor_options(cfg, any(n.get("GPU") for n in nodes))[1]
    return ray.remote(cls).options(**opts, name=engine_name(index) + suffix).remote(
        cfg.model.path, **{"num_threads": threads, **engine_kwargs(cfg, index)})


def _host(loopback: bool) -> str:
    """The ranks' rendezvous address (the driver's): 127.0.0.1, or its IP for remote ranks."""
    return "127.0.0.1" if loopback else ray.util.get_node_ip_address()


def rendezvous(host: str, timeout_s: float) -> Any:
    """A rendezvous store (the trainer ranks', the weight-sync group's), served here on a port the
    OS picks as it binds (a port found free, bound later, was taken meanwhile once: EADDRINUSE)."""
    import torch.distributed as dist
    return dist.TCPStore(host, 0, None, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def rank_placement(n: int, options: dict, timeout_s: float) -> tuple[list[dict], str, Any]:
    """Ray options of each of `n` trainer ranks, the host of their rendezvous store (the driver's;
    loopback when every rank shares its node) and the placement group to remove at shutdown.

    One node, or ranks reserving nothing: plain actors on the driver's node. Several nodes: a
    PACK placement group of one bundle per rank, so their nodes are known before they start."""
    if not ray.is_initialized():            # embedded: the one rank is in the driver
        return [options] * n, _host(True), None
    need = reserved(options)
    if not need or sum(node["Alive"] for node in ray.nodes()) == 1:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return [{**options, "scheduling_strategy": here}] * n, _host(True), None
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    pg = placement_group([need] * n, strategy="PACK")
    if not pg.wait(timeout_seconds=timeout_s):
        ray.util.remove_placement_group(pg)
        raise TimeoutError(f"{n} trainer ranks of {need} could not be placed within {timeout_s}s "
                           "(trainer.timeout_s): the cluster lacks free resources")
    nodes = set(placement_group_table(pg)["bundles_to_node_id"].values())
    host = _host(nodes == {ray.get_runtime_context().get_node_id()})
    return [{**options, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=i)} for i in range(n)], host, pg


def local_node(cfg: Config) -> list[dict[str, float]]:
    """A local run's one node (no `ray.address`): `ray.num_cpus` CPUs (else all) and the GPUs."""
    import torch
    return [{"CPU": float(cfg.ray.num_cpus or os.cpu_count() or 1),
             "GPU": float(torch.cuda.device_count())}]


def reserved(opts: dict) -> dict[str, float]:
    """What an actor's Ray options reserve, {resource: amount > 0} (empty: nothing)."""
    need = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], **opts["resources"]}
    return {k: float(v) for k, v in need.items() if v}


def check_resources(cfg: Config, rank_opts: dict, engine_opts: dict,
                    nodes: list[dict[str, float]]) -> None:
    """Raise `ConfigError` unless every actor fits on some node and the totals fit the cluster
    (`nodes`: each alive node's resources). Bin packing across nodes is left to Ray."""
    roles = [("trainer rank", cfg.trainer.num_ranks, reserved(rank_opts), "trainer"),
             ("engine", cfg.engine.num_engines, reserved(engine_opts), "engine")]
    total = {k: sum(n.get(k, 0.0) for n in nodes) for r in roles for k in r[2]}
    for role, _, need, section in roles:
        if need and not any(all(n.get(k, 0.0) >= v for k, v in need.items()) for n in nodes):
            raise ConfigError(
                f"one {role} needs {need} (from {section}.gpus_per_*/cpus_per_*/resources) but no "
                f"Ray node has that much; nodes: {[_short(n) for n in nodes]}")
    for k, have in total.items():
        want = sum(count * need.get(k, 0.0) for _, count, need, _ in roles)
        if want > have + 1e-9:
            parts = " + ".join(f"{count} {role}s x {need.get(k, 0.0):g}"
                               for role, count, need, _ in roles if need.get(k))
            raise ConfigError(
                f"the run needs {want:g} {k} ({parts}) but the Ray cluster has {have:g}: lower "
                "trainer.num_ranks / engine.num_engines (or the per-actor amounts), or point "
                "ray.address at a larger cluster")


def _placement(actors: list) -> dict[str, int]:
    """{node id (first 12 hex digits): actors there}: where Ray put each role."""
    ids = ray.get([a.__ray_call__.remote(
        lambda _: ray.get_runtime_context().get_node_id()) for a in actors], timeout=60)
    return {n[:12]: ids.count(n) for n in dict.fromkeys(ids)}


def _short(node: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in node.items() if k in ("CPU", "GPU") or not k.startswith(("node:",
            "memory", "object_store_memory", "accelerator_type"))}


@contextmanager
def start(cfg: Config, plugins: Any, trainer: bool = True) -> Iterator[tuple[Any, list[Any]]]:
    """Yield `(policy, engines)` (policy None without `trainer`); everything started here is
    stopped on exit. Embedded (`embedded`): no Ray, the same handles in the driver's process."""
    import torch
    import torch.distributed as dist
    local = (embedded(cfg, trainer, torch.cuda.is_available())    # a process group here: the
             and not (trainer and dist.is_initialized()))         # rank goes to an actor
    _starts[0] += 1
    started = not local and init_ray(cfg)
    engines, policy = [], None
    try:
        nodes = (local_node(cfg) if local else
                 [n["Resources"] for n in ray.nodes() if n["Alive"]])
        rank_opts, engine_opts = actor_options(cfg, any(n.get("GPU") for n in nodes))
        check_resources(cfg, rank_opts, engine_opts, nodes)
        backend = plugins.get("trainer_backend", cfg.trainer.backend)
        rank_threads, engine_threads = num_threads(cfg, int(min(n.get("CPU", 1) for n in nodes)))
        engines = [spawn_engine(cfg, plugins, i, local=local)
                   for i in range(cfg.engine.num_engines)]
        carry = cfg.model.init_lora == "carry" and cfg.model.init_from   # base + its adapters
        policy = backend(carry or cfg.model.path, cfg.trainer, dtype=cfg.model.dtype, seed=cfg.seed,
                         num_threads=rank_threads, actor_options=rank_opts) if trainer else None
        actors.get([e.get_version.remote() for e in engines], timeout=cfg.engine.timeout_s)
        # freeze torch/transformers/Ray objects: a full collection over them stalled rollouts ~0.7 s
        gc.freeze()
        log.info("cluster_ready", mode="embedded" if local else "ray", engines=len(engines),
                 trainer_ranks=cfg.trainer.num_ranks,
                 threads={"rank": rank_threads, "engine": engine_threads},
                 rank_resources=reserved(rank_opts), engine_resources=reserved(engine_opts),
                 rank_nodes="driver" if local or getattr(policy, "in_driver", False)
                 else _placement(getattr(policy, "workers", [])),
                 engine_nodes="driver" if local else _placement(engines))
        yield policy, engines
    finally:
        gc.unfreeze()                    # what this run leaves may be collected
        if policy is not None:
            policy.shutdown()
        for e in engines:
            e.kill() if isinstance(e, actors.LocalActor) else ray.kill(e)
        if started:
            _shutdown()
