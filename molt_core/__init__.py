"""Molt: a lean, PyTorch-native framework for reinforcement learning of LLM agents."""

from molt_core.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl"]
