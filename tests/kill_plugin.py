"""Test plugin (`--plugin kill_plugin`, tests/ on PYTHONPATH): records the task ids each step
trains and SIGKILLs its own driver at a chosen point, as `kill -9` would."""

from __future__ import annotations

import json
import os
import signal

from molt_core import hookimpl

_saves = 0


@hookimpl
def molt_filter_batch(groups, step):
    path = os.environ.get("MOLT_TEST_TASKS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "groups": [g[0].group_id for g in groups]}) + "\n")


@hookimpl
def molt_on_step_end(step):
    if step == int(os.environ.get("MOLT_TEST_KILL_AFTER_STEP", -1)):
        os.kill(os.getpid(), signal.SIGKILL)


@hookimpl
def molt_state_dict():
    """Called in the middle of a checkpoint write: policy shards written, driver state not."""
    global _saves
    _saves += 1
    if _saves == int(os.environ.get("MOLT_TEST_KILL_IN_SAVE", -1)):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"saves": _saves}


@hookimpl
def molt_load_state_dict(state):
    global _saves
    _saves = state["saves"]
    print(f"kill_plugin restored: {state}")
