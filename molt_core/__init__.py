"""Molt: a lean, PyTorch-native framework for reinforcement learning of LLM agents."""

from molt_core.hookspecs import hookimpl

__version__ = "0.1.0"
# Bumped when a hook's signature or contract changes incompatibly; plugins declare the range they
# support with a module attribute, e.g. `MOLT_HOOK_API = ">=1,<2"`.
HOOK_API_VERSION = 1
__all__ = ["HOOK_API_VERSION", "hookimpl"]
