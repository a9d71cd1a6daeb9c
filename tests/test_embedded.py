"""The embedded mode (`ray.embedded`): no Ray daemons, the engine on a thread of the driver, the
same Generator, schemes, weight sync and checks above the process boundary; step for step the
same run as through Ray."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from molt_core.cli import load
from molt_core.run import actors, cluster


class Counter:
    def __init__(self, start: int) -> None:
        self.n, self.thread = start, threading.current_thread().name

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    async def slow(self, s: float) -> str:
        await asyncio.sleep(s)
        return threading.current_thread().name

    async def fail(self) -> None:
        raise ValueError("engine-side error")


def test_local_actor_calls_like_a_ray_actor() -> None:
    a = actors.LocalActor(Counter, 1, name="c")
    try:
        assert a._instance.thread == "molt-c"            # built on its own thread
        assert actors.get(a.add.remote(2), timeout=5) == 3
        assert actors.get([a.add.remote(1), a.add.remote(1)], timeout=5) == [4, 5]
        assert asyncio.run(_await(a.slow.remote(0))) == "molt-c"
        slow, fast = a.slow.remote(30), a.slow.remote(0)   # coroutines interleave
        done, pending = actors.wait([slow, fast], num_returns=1, timeout=10)
        assert done == [fast] and pending == [slow]
        with pytest.raises(TimeoutError):
            actors.get(slow, timeout=0.05)
        with pytest.raises(ValueError, match="engine-side error"):
            actors.get(a.fail.remote(), timeout=5)
        assert not hasattr(a, "missing") and hasattr(a, "add")
        assert actors.is_local([a]) and not actors.is_local([])
    finally:
        a.kill()
    assert not a._thread.is_alive()                      # the pending `slow` was cancelled


async def _await(ref: actors.LocalRef) -> str:
    return await asyncio.wait_for(ref, 5)


@pytest.mark.parametrize("override, expected", [
    ({}, True), ({"engine.num_engines": 2}, False), ({"ray.address": "auto"}, False),
    ({"engine.name": "vllm"}, False), ({"trainer.num_ranks": 2}, False),
    ({"trainer.cpus_per_rank": 1.0}, False), ({"ray.embedded": "off"}, False),
    ({"ray.embedded": "on", "engine.num_engines": 2}, True)])
def test_auto_goes_embedded_only_where_nothing_needs_ray(override: dict, expected: bool,
                                                         tiny_model_dir: Path) -> None:
    cfg = load(None, [f"model.path={tiny_model_dir}", "agent.args.env=next_letter"])[0]
    for key, value in override.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    assert cluster.embedded(cfg, trainer=True, cuda=False) is expected
    assert not cluster.embedded(cfg, trainer=True, cuda=True) or cfg.ray.embedded == "on"


def _run(recipe: str, tmp: Path, ray_tmp: Path, mode: str) -> Path:
    out = tmp / mode
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp / mode)}   # short: unix socket paths
    proc = subprocess.run([sys.executable, "-m", "molt_tools", "run", recipe, "--no-progress",
                           f"ray.embedded={mode}", f"out_dir={out}", "trainer.steps=4",
                           "rollout.groups_per_step=4", "sampling.max_new_tokens=3"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"mode={'embedded' if mode == 'on' else 'ray'}" in proc.stderr + proc.stdout)
    return next(out.iterdir())


def test_embedded_run_is_step_for_step_the_ray_run(tiny_recipe: str, tmp_path: Path) -> None:
    """Sync, one seed: every metric but times and memory, and the final weights, identical."""
    data = yaml.safe_load(open(tiny_recipe))
    data["check"] = {"consistency_every": 1, "canary_every": 1}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(data))
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    try:
        runs = {m: _run(str(recipe), tmp_path, ray_tmp, m) for m in ("on", "off")}
        assert not (ray_tmp / "on").exists() and (ray_tmp / "off").exists()   # no Ray started
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    rows = {m: [json.loads(line) for line in open(d / "metrics.jsonl")] for m, d in runs.items()}
    assert len(rows["on"]) == len(rows["off"]) == 4
    for a, b in zip(rows["on"], rows["off"]):
        keys = {k for k in a if not k.startswith(("time", "memory/")) and not k.endswith("_s")}
        assert keys and {k: a[k] for k in keys} == {k: b.get(k) for k in keys}
    assert rows["on"][-1]["check/canary_max_abs"] < 1e-4
    on, off = (load_file(runs[m] / "final/model.safetensors") for m in ("on", "off"))
    assert on.keys() == off.keys() and all(on[k].equal(off[k]) for k in on)


_TEAMS = """import os, time, torch
from molt_core.policy.handle import _InDriver
from molt_core.run.actors import LocalActor, get

class Work:
    def __init__(self):
        torch.set_num_threads(2)
    def run(self):          # an op torch splits over its OpenMP team
        torch.ones(4_000_000).mul_(2)
        return tasks()

def tasks():
    return len(os.listdir("/proc/self/task"))

def settle(n):              # a released worker leaves the task list once it has exited
    for _ in range(3000):
        if tasks() == n:
            break
        time.sleep(0.01)
    return tasks()

torch.set_num_threads(2)
base = tasks()
actor = LocalActor(Work)
during = get(actor.run.remote())
print(base, during, settle(base + 1))
print(base + 1, _InDriver(Work()).run.remote(), settle(base + 1))
"""


def test_each_thread_lets_its_openmp_team_go_when_its_work_is_done() -> None:
    """Embedded, the engine (a `LocalActor`) and the trainer (`_InDriver`) compute on two threads
    of one process: each lets its OpenMP worker exit once its calls are done, so the other phase
    runs with one team (docs/benchmarks.md, "Two teams")."""
    proc = subprocess.run([sys.executable, "-c", _TEAMS], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (base, during, after), (base2, during2, after2) = (
        map(int, line.split()) for line in proc.stdout.split("\n")[:2])
    assert during == base + 2 and after == base + 1     # the actor's thread stays, its worker goes
    assert during2 == base2 + 1 and after2 == base2     # the driver's worker too
