"""What plugins hand to the core, and what the core hands to them, as `typing.Protocol`s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from molt_core.trajectory import Completion

__all__ = ["RolloutContext"]


@dataclass
class RolloutContext:
    """What an agent gets for one rollout."""
    group_id: int
    rollout_id: int
    task: int                                   # task index: env seed or dataset row
    sampling: dict                              # explicit sampling params for the engine
    generate: Callable[..., Awaitable[Completion]]   # generate(prompt_ids, sampling=None,
                                                     #          images=None)
    tokenizer: Any
