"""Env `dataset`: rows of a local dataset as prompts, plain Python functions as the reward.

A reward function is named `module:function` (or `path/file.py:function`). One whose first
parameter is `completions` is TRL's `reward_funcs` form, called as `fn(completions=[..],
prompts=[..], **{column: [..]})` and returning a list of floats (None: not applicable); any other
is Molt's per-rollout form, `fn(completion, **columns) -> float | (float, info)`. Either may be
async; each gets only the columns it names unless it takes `**kwargs`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import random
from typing import Any, Callable

from molt_core.contracts import Env, Observation
from molt_core.plugins import import_module
from molt_gym.envs import _split

__all__ = ["Dataset"]

TASKS_PER_SEED = 1_000_003      # training's task = seed * 1_000_003 + group id (Generator.task_of)


@functools.lru_cache(maxsize=8)
def _functions(spec: tuple[tuple[str, float], ...]) -> tuple[tuple[str, Callable, float], ...]:
    out = []
    for name, weight in spec:
        module, _, attr = name.rpartition(":")
        try:
            out.append((name, getattr(import_module(module), attr), float(weight)))
        except (ImportError, OSError, AttributeError, ValueError) as e:
            raise ValueError(f"reward '{name}': {type(e).__name__}: {e} (expected "
                             "module:function or path/file.py:function)") from None
    return tuple(out)


async def _call(fn: Callable, completion: str, prompt: Observation, columns: dict) -> Any:
    params = inspect.signature(fn).parameters
    trl = "completions" in params
    if trl:
        reply = [{"role": "assistant", "content": completion}] if isinstance(prompt, list) \
            else completion
        kwargs = {"completions": [reply], "prompts": [prompt],
                  **{k: [v] for k, v in columns.items()}}
    else:
        kwargs = {"prompt": prompt, **columns}
        kwargs.pop(next(iter(params), ""), None)
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    args = () if trl else (completion,)
    out = fn(*args, **kwargs) if inspect.iscoroutinefunction(fn) else \
        await asyncio.to_thread(fn, *args, **kwargs)
    out = await out if inspect.isawaitable(out) else out
    if trl:
        if not isinstance(out, (list, tuple)) or len(out) != 1:
            raise TypeError(f"returned {out!r}; expected a list of one float (or None) per "
                            "completion")
        out = out[0]
    value, info = out if isinstance(out, tuple) else (out, {})
    return None if value is None else float(value), info


class Dataset(Env):
    """Single turn: row i's `prompt` column (text or chat messages) is the observation; the
    reward is the weighted sum of `reward`'s functions (a name, a list, or {name: weight}) of the
    reply and the row's columns. `data`: a JSONL / Parquet / CSV file or a `datasets` directory,
    or {split: file}; splits as in env `math`. Training reads the train split in epochs, shuffled
    by the run's seed each epoch (`shuffle: false`: in file order); the task cursor in
    checkpoints is the epoch cursor."""

    def __init__(self, *, data: str | dict, reward: str | list | dict, prompt: str = "prompt",
                 split: str = "train", test_fraction: float = 0.1, shuffle: bool = True) -> None:
        files = tuple(sorted(data.items())) if isinstance(data, dict) else data
        self.rows = _split(files, split, test_fraction, (prompt,))
        spec = reward.items() if isinstance(reward, dict) else \
            [(r, 1.0) for r in ([reward] if isinstance(reward, str) else reward)]
        self.functions = _functions(tuple(spec))
        self.prompt, self.shuffle = prompt, shuffle and split == "train"

    async def reset(self, seed: int) -> Observation:
        epoch_start = seed - (seed % TASKS_PER_SEED) % len(self.rows)
        order = _order(epoch_start, len(self.rows)) if self.shuffle else range(len(self.rows))
        self.index = order[seed - epoch_start]
        self.row = self.rows[self.index]
        return self.row[self.prompt]

    async def step(self, action: str) -> tuple[None, float, bool, dict]:
        columns = {k: v for k, v in self.row.items() if k != self.prompt}
        total, scored, info = 0.0, False, {"row": self.index}
        for name, fn, weight in self.functions:
            try:
                value, extra = await _call(fn, action, self.row[self.prompt], columns)
            except Exception as e:
                raise RuntimeError(f"reward function '{name}' failed on row {self.index} "
                                   f"({self.row[self.prompt]!r:.60}): {type(e).__name__}: "
                                   f"{e}") from e
            info.update(extra)
            if value is not None:
                total, scored, info[f"reward/{name}"] = total + weight * value, True, value
        if not scored:
            raise ValueError(f"every reward function returned None for row {self.index}")
        return None, total, True, info


@functools.lru_cache(maxsize=4)
def _order(epoch_start: int, n: int) -> list[int]:
    order = list(range(n))
    random.Random(epoch_start).shuffle(order)
    return order
