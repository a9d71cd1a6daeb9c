"""Test plugin (`--plugin kill_plugin`, tests/ on PYTHONPATH): records the task ids each step
trains, SIGKILLs its own driver (with its trajectory writer: as a scheduler cancelling the job
would) or engine 0's process at a chosen point (as `kill -9` would), or fills the "disk"."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from molt_core import hookimpl

_saves = 0


def _pid(_actor) -> int:
    return os.getpid()


def _kill_engine(when: str, step: int) -> None:
    """MOLT_TEST_KILL_ENGINE=WHEN:STEP (WHEN: filter, before the train step; end, after it;
    save: inside the STEP-th checkpoint write)."""
    if os.environ.get("MOLT_TEST_KILL_ENGINE") == f"{when}:{step}":
        import ray
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        from molt_core.run.cluster import engine_name
        engine = ray.get_actor(engine_name(0))
        os.kill(ray.get(engine.__ray_call__.remote(_pid), timeout=60), signal.SIGKILL)


@hookimpl
def molt_filter_batch(groups, step):
    _kill_engine("filter", step)
    path = os.environ.get("MOLT_TEST_TASKS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "groups": [g[0].group_id for g in groups]}) + "\n")


@hookimpl
def molt_on_step_end(step):
    _kill_engine("end", step)
    if step == int(os.environ.get("MOLT_TEST_KILL_AFTER_STEP", -1)):
        if os.environ.get("MOLT_TEST_KILL_WRITER"):
            import psutil
            for child in psutil.Process().children():
                if "trajectory_store" in " ".join(child.cmdline()):
                    child.kill()
        os.kill(os.getpid(), signal.SIGKILL)
    fill_at, _, leave = os.environ.get("MOLT_TEST_FILL_DISK_AT", "-1:").partition(":")
    if step == int(fill_at):      # a real full disk (the run dir on a small tmpfs, `disk.py`)
        from disk import fill
        fill(Path(os.environ["MOLT_TEST_OUT_DIR"]), int(leave))
    if step == int(os.environ.get("MOLT_TEST_DISK_FULL_AT_STEP", -1)):
        # as a full disk would: files of the run can grow by 40 more bytes at most
        import resource
        import glob
        (metrics,) = glob.glob(os.path.join(os.environ["MOLT_TEST_OUT_DIR"], "*/metrics.jsonl"))
        size = os.path.getsize(metrics)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, resource.RLIM_INFINITY))


@hookimpl
def molt_state_dict():
    """Called in the middle of a checkpoint write: policy shards written, driver state not."""
    global _saves
    _saves += 1
    _kill_engine("save", _saves)
    if _saves == int(os.environ.get("MOLT_TEST_KILL_IN_SAVE", -1)):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"saves": _saves}


@hookimpl
def molt_load_state_dict(state):
    global _saves
    _saves = state["saves"]
    print(f"kill_plugin restored: {state}")
