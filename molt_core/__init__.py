"""Molt: a lean, PyTorch-native framework for reinforcement learning of LLM agents."""

import importlib
from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("molt")     # `@molt_core.hookimpl` marks a plugin's hooks

__version__ = "0.1.0"
# Bumped when a hook's signature or contract changes incompatibly; plugins declare the range they
# support with a module attribute, e.g. `MOLT_HOOK_API = ">=1,<2"`.
HOOK_API_VERSION = 1
__all__ = ["Config", "HOOK_API_VERSION", "Run", "evaluate", "export", "hookimpl", "load_recipe",
           "sft", "train"]
# the Python API (molt_core.api), imported on first use: `import molt_core` imports no torch
_LAZY = {"Config": "molt_core.config", "export": "molt_core.run.checkpoint", "Run": "molt_core.api",
         "evaluate": "molt_tools.evaluate", "load_recipe": "molt_core.api",
         "sft": "molt_core.api", "train": "molt_core.api"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'molt_core' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
