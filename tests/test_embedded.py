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


_OMP = """import os, sys
from molt_core.run import cluster
with cluster.prestart(sys.argv[1], []):
    print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
if sys.argv[2] == "ray":        # the guess was wrong (a CUDA box): Ray starts after all
    cluster._start_local(cluster.load_config(sys.argv[1], []))
    print(os.environ.get("OMP_WAIT_POLICY"))
    cluster._shutdown()
"""


@pytest.mark.parametrize("user", ["", "passive"])
def test_prestart_sets_active_omp_wait_for_one_process_only(user: str, tiny_recipe: str) -> None:
    """Embedded, engine and trainer are two OpenMP teams in one process: `prestart` sets
    OMP_WAIT_POLICY=active before torch loads (docs/benchmarks.md, "Two teams"). A user's own
    value stays; where Ray starts after all, its actors (a process each) do not inherit ours."""
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")         # short: unix socket paths
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update({"RAY_TMPDIR": ray_tmp}, **({"OMP_WAIT_POLICY": user} if user else {}))
    try:
        proc = subprocess.run([sys.executable, "-c", _OMP, tiny_recipe, "" if user else "ray"],
                              env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    assert lines[0] == f"{user or 'active'} False"
    assert user or lines[1] == "None"
