"""Data environments: `math` (a local file's problems, math-verify) and `dataset` (a local
dataset's rows, plain Python functions as the reward, TRL's `reward_funcs` too; docs/data.md).
`Env`: `molt_core.contracts`; the toy environments of the CPU recipes: `molt_examples.toy_envs`."""

from __future__ import annotations

import asyncio
import functools
import inspect
import zlib
from typing import Any, Callable

import numpy as np

from molt_core.contracts import Env, Observation
from molt_core.data import read_rows as _rows
from molt_core.plugins import import_module
from molt_core.trajectory import as_reward

__all__ = ["Dataset", "Env", "MathProblems", "Observation"]


@functools.lru_cache(maxsize=8)
def _split(path: str, split: str, test_fraction: float, need: tuple[str, ...] = ("prompt", "answer")
           ) -> tuple[tuple[dict, ...], tuple[int, ...]]:
    """`split`'s rows and their places in the file (`_rows`): a row's own "split" field, else a
    hash of its prompt (test: `test_fraction` of them), so no held-out row is a training row."""
    rows = _rows(path)
    bad = [i for i, (_, r) in enumerate(rows) if not set(need) <= set(r)]
    if not rows or bad:
        raise ValueError(f"{path}: expected rows with {', '.join(map(repr, need))} "
                         f"({'no rows' if not rows else f'row {bad[0]} lacks them'})")
    for n, r in rows:        # text, or chat messages ({"role", "content"} objects)
        if not (isinstance(p := r[need[0]], str) or isinstance(p, list) and p and all(
                isinstance(m, dict) and "role" in m for m in p)):
            raise ValueError(f"{path}: row {n}'s {need[0]!r} is {type(p).__name__} {p!r:.40}; "
                             "it must be text or a list of chat messages ({role, content})")
    def side(row: dict) -> str:
        held = zlib.crc32(str(row[need[0]]).encode()) % 10_000 < test_fraction * 10_000
        return row.get("split", "test" if held else "train")
    if not (kept := [(n, r) for n, r in rows if side(r) == split]):
        raise ValueError(f"{path}: no '{split}' rows (test_fraction={test_fraction}, rows' "
                         "own 'split' field)")
    lines, rows = zip(*kept)
    return rows, lines


class MathProblems(Env):
    """Single-turn math: task i is row i (mod len) of `split` ("train" | "test", as `_split` splits)
    of a local JSONL file of {"prompt", "answer"} rows (e.g. DAPO-Math-17k converted once, offline).
    Reward 1 if the reply's \\boxed{} answer equals the reference (the `math` reward, math-verify;
    plugin molt-reward-math)."""

    boxed = True          # the reply must box its answer
    split_by = ("data", "test_fraction")      # eval may not change these (molt_core.rollout.eval)

    def __init__(self, *, data: str, instruction: str = "", split: str = "train",
                 test_fraction: float = 0.1) -> None:
        self.rows, self.instruction = _split(data, split, test_fraction)[0], instruction

    async def reset(self, seed: int) -> Observation:
        self.row = self.rows[seed % len(self.rows)]
        return self.row["prompt"] + self.instruction

    async def step(self, action: str) -> tuple[None, float, bool, dict]:
        try:
            from molt_reward_math import math_reward
        except ImportError:
            raise RuntimeError("env 'math' needs the math reward: pip install -e "
                               "plugins/rewards/math") from None
        # sympy parsing is CPU work: off the generator's event loop
        reward, info = await asyncio.to_thread(math_reward, action, str(self.row["answer"]),
                                               require_boxed=self.boxed)
        return None, reward, True, info


TASKS_PER_SEED = 1_000_003      # training's task = seed * 1_000_003 + group id (Generator.task_of)


@functools.lru_cache(maxsize=8)
def _functions(spec: tuple[tuple[str, float], ...]) -> tuple[tuple[str, Callable, float], ...]:
    out = []
    for name, weight in spec:
        module, _, attr = name.rpartition(":")
        try:
            out.append((name, getattr(import_module(module), attr), float(weight)))
        except (ImportError, OSError, AttributeError, ValueError) as e:
            raise ValueError(f"reward '{name}' (module:function): {type(e).__name__}: {e}") \
                from None
    return tuple(out)


async def _call(fn: Callable, completion: str, prompt: Observation, columns: dict) -> Any:
    """TRL's form (first parameter `completions`): lists in, one float or None per completion
    out; else Molt's: `fn(completion, prompt=.., **columns) -> float | (float, info)`."""
    params = inspect.signature(fn).parameters
    trl = "completions" in params
    reply = [{"role": "assistant", "content": completion}] if type(prompt) is list else completion
    kwargs = {"completions": [reply], "prompts": [prompt], **{k: [v] for k, v in columns.items()}
              } if trl else {"prompt": prompt, **columns}
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    args = () if trl else (completion,)
    out = fn(*args, **kwargs) if inspect.iscoroutinefunction(fn) else \
        await asyncio.to_thread(fn, *args, **kwargs)
    out = await out if inspect.isawaitable(out) else out
    if trl and (not isinstance(out, (list, tuple)) or len(out) != 1):
        raise TypeError(f"returned {out!r}; expected a list of one float (or None) per completion")
    out = out[0] if trl else out
    value, info = out if isinstance(out, tuple) else (out, {})
    return None if value is None else as_reward(value), info


class Dataset(Env):
    """Single turn: a row's `prompt` column (text or chat messages) is the observation; the reward
    is the weighted sum of `reward`'s functions (a name, a list or {name: weight}) of the reply and
    the row's columns. The train split is read in epochs, each shuffled by the run's seed."""

    split_by = ("data", "prompt", "test_fraction")

    def __init__(self, *, data: str, reward: str | list | dict, prompt: str = "prompt",
                 split: str = "train", test_fraction: float = 0.1, shuffle: bool = True) -> None:
        self.rows, self.lines = _split(data, split, test_fraction, (prompt,))
        spec = reward.items() if isinstance(reward, dict) else \
            [(r, 1.0) for r in ([reward] if isinstance(reward, str) else reward)]
        self.functions = _functions(tuple(spec))
        self.prompt, self.shuffle = prompt, shuffle and split == "train"

    async def reset(self, seed: int) -> Observation:
        # epoch and row from the task cursor (checkpoints save it); eval tasks: in order
        epoch_start = seed - (seed % TASKS_PER_SEED) % len(self.rows)
        self.index = int(_order(epoch_start, len(self.rows))[seed - epoch_start]) if \
            self.shuffle else (seed % TASKS_PER_SEED) % len(self.rows)
        self.row = self.rows[self.index]
        return self.row[self.prompt]

    async def step(self, action: str) -> tuple[None, float, bool, dict]:
        """Functions returning None are skipped; if all do, NaN (the rollout is dropped). Info:
        the row (`row`: in the split; `line`: in the file, `_rows`) and the columns compared."""
        columns = {k: v for k, v in self.row.items() if k != self.prompt}
        total, scored = 0.0, False
        info = {"row": self.index, "line": self.lines[self.index], "columns": columns}
        for name, fn, weight in self.functions:
            try:
                value, extra = await _call(fn, action, self.row[self.prompt], columns)
            except Exception as e:
                raise RuntimeError(f"reward function '{name}' failed on row {self.index} "
                                   f"({self.row[self.prompt]!r:.60}): {type(e).__name__}: {e}"
                                   ) from e
            info.update(extra)
            if value is not None:
                total, scored, info[f"reward/{name}"] = total + weight * value, True, value
        return None, total if scored else float("nan"), True, info


@functools.lru_cache(maxsize=4)
def _order(epoch_start: int, n: int) -> np.ndarray:
    return np.random.default_rng(epoch_start).permutation(n)
