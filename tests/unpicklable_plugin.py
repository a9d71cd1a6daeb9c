"""Test plugin (`--plugin unpicklable_plugin`, tests/ on PYTHONPATH): its molt_state_dict returns
a value no checkpoint can hold (a lambda)."""

from __future__ import annotations

from molt_core import hookimpl


@hookimpl
def molt_state_dict():
    return {"fn": lambda x: x}
