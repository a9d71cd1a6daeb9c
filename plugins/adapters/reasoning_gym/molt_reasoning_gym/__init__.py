"""reasoning-gym's procedural tasks as env `reasoning_gym`, scored by their own `score_answer`."""

import ast
import difflib
import functools
import re
from typing import Any, Literal

from molt_core import hookimpl
from molt_core.config import ConfigError
from molt_gym.envs import Env, Observation

__all__ = ["ReasoningGym"]


@functools.lru_cache(maxsize=8)
def _split(task: str, split: str, test_size: int, config: str) -> tuple[Any, frozenset]:
    from reasoning_gym.factory import DATASETS, create_dataset   # ~3 s: only when used
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=5, cutoff=0.5) or sorted(DATASETS)[:8]
        raise ConfigError(f"reasoning-gym task '{task}' unknown; close names: {', '.join(close)}")
    make = functools.partial(create_dataset, task, **ast.literal_eval(config) or {})
    held = frozenset(map(lambda e: e["question"], test := make(seed=10**9, size=test_size)))
    return (test, frozenset()) if split == "test" else (make(seed=0, size=10**9), held)


class ReasoningGym(Env):
    """Single turn: an item of `task` (`config`: its keys) scored by the task on the reply (or on
    group 1 of regex `answer`); test's items use seeds from 1e9, train's skip test's questions."""

    split_by = ("task", "test_size", "config")     # eval may not change these

    def __init__(self, *, task: str, split: Literal["train", "test"] = "train",
                 test_size: int = 200, config: dict | None = None, answer: str = "") -> None:
        self.data, self.skip, self.answer = *_split(task, split, test_size, repr(config)), answer

    async def reset(self, seed: int) -> Observation:
        for self.entry in (self.data[i % len(self.data)] for i in range(seed, seed + 1000)):
            if self.entry["question"] not in self.skip:
                return self.entry["question"]
        raise ValueError("1000 train questions in a row are test questions: widen the config")

    async def step(self, action: str) -> tuple[None, float, bool, dict]:
        reply = (found := re.search(self.answer, action)) and found[1] if self.answer else action
        return None, float(self.data.score_answer(reply and reply.strip(), self.entry)), True, {}


@hookimpl
def molt_envs() -> dict:
    return {"reasoning_gym": ReasoningGym}


@hookimpl
def molt_configure(cfg: Any, plugins: Any) -> None:
    if cfg.agent.name == "gym" and cfg.agent.args.get("env") == "reasoning_gym":  # before the run
        ReasoningGym(**cfg.agent.args.get("env_args") or {})
