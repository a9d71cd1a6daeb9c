"""torch imported on first use: `from molt_core.lazy import torch` binds a stand-in module whose
first attribute read imports torch, so the commands that load the plugins but touch no tensor
(`molt plugins`, `validate`, `config`) skip torch's seconds of import time."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = ["LazyModule", "torch"]


class LazyModule(ModuleType):
    """Forwards every attribute read to the module of its name, imported then. Not for names
    imported with `from x import y` (those read x at once): import them inside the function."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attr)


if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")
