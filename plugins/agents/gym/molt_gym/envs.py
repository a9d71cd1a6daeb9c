"""The toy environments the CPU recipes learn, and `dataset`: a local dataset's rows, plain Python
functions as the reward (TRL's `reward_funcs` too; docs/data.md). `Env`: `molt_core.contracts`."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import random
import string
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from molt_core.contracts import Env, Observation
from molt_core.plugins import import_module

__all__ = ["Addition", "Arithmetic", "Colours", "Dataset", "Env", "GuessNumber", "MathProblems",
           "NextLetter", "Observation", "Spell"]


class NextLetter(Env):
    """"after c" -> "d", on the reply's first character (rewards: docs/environments.md)."""

    def __init__(self, letters: str = "abcdefgh", window: int = 2) -> None:
        self.letters, self.window = letters, window

    async def reset(self, seed: int) -> Observation:
        self.letter = random.Random(seed).choice(self.letters)
        return f"after {self.letter}"

    async def step(self, action: str) -> tuple[None, float, bool, dict]:
        target = chr(ord(self.letter) + 1)
        first = action.strip()[:1]
        if first == target:
            reward = 1.0
        elif first and first in string.ascii_lowercase:
            reward = 0.1 + 0.5 * max(0.0, 1.0 - abs(ord(first) - ord(target)) / self.window)
        else:
            reward = 0.0
        return None, reward, True, {"correct": first == target}


class Addition(Env):
    """"what is 3 plus 4?" -> "7" (operands 0..hi), on the reply's first character."""

    def __init__(self, hi: int = 4) -> None:
        self.hi = hi

    async def reset(self, seed: int) -> Observation:
        rng = random.Random(seed)
        self.a, self.b = rng.randint(0, self.hi), rng.randint(0, self.hi)
        return f"what is {self.a} plus {self.b}?"

    async def step(self, action: str) -> tuple[None, float, bool, dict]:
        first = action.strip()[:1]
        right = first == str(self.a + self.b)
        return None, 1.0 if right else 0.1 if first.isdigit() else 0.0, True, {"correct": right}


class Spell(Env):
    """A multi-token answer: "bdca=" -> "acdb" (`task` reverse) or "cedb" (shift); each answer
    letter is scored, so every answer token moves the reward (docs/environments.md)."""

    TASKS = {"reverse": lambda s: s[::-1], "shift": lambda s: "".join(chr(ord(c) + 1) for c in s)}

    def __init__(self, task: str = "reverse", letters: str = "abcdefgh", length: int = 4) -> None:
        if task not in self.TASKS:
            raise ValueError(f"spell task '{task}' unknown; valid: {', '.join(self.TASKS)}")
        self.task, self.letters, self.length = task, letters, length

    async def reset(self, seed: int) -> Observation:
        rng = random.Random(seed)
        self.source = "".join(rng.choice(self.letters) for _ in range(self.length))
        self.target = self.TASKS[self.task](self.source)
        return f"{self.source}="

    async def step(self, action: str) -> tuple[None, float, bool, dict]:
        got = action[:self.length]
        score = [1.0 if a == t else 0.1 if a in string.ascii_lowercase else 0.0
                 for a, t in zip(got, self.target)]
        return None, sum(score) / self.length, True, {"correct": got == self.target}


class GuessNumber(Env):
    """Guess a digit in [lo, hi] with "higher"/"lower" feedback; multi-turn, 1 when right."""

    def __init__(self, lo: int = 1, hi: int = 8) -> None:
        self.lo, self.hi = lo, hi

    async def reset(self, seed: int) -> Observation:
        self.secret = random.Random(seed).randint(self.lo, self.hi)
        return f"guess a number from {self.lo} to {self.hi}"

    async def step(self, action: str) -> tuple[Observation | None, float, bool, dict]:
        text = action.strip()[:1]
        if not text.isdigit():
            return None, 0.0, True, {"invalid": True}
        guess = int(text)
        if guess == self.secret:
            return None, 1.0, True, {"solved": True}
        return ("higher" if guess < self.secret else "lower"), 0.0, False, {}


@functools.lru_cache(maxsize=4)
def _rows(path: str) -> tuple[dict, ...]:
    """A JSONL, Parquet or CSV file's rows, or a `datasets` directory's (save_to_disk)."""
    if Path(path).is_dir():     # a DatasetDict's splits are its rows' "split"
        from datasets import DatasetDict, load_from_disk
        ds = load_from_disk(path)
        return tuple({**r, "split": s} for s, d in ds.items() for r in d.to_list()) \
            if isinstance(ds, DatasetDict) else tuple(ds.to_list())
    if path.endswith((".parquet", ".csv")):
        from pyarrow import csv, parquet
        read = parquet.read_table if path.endswith(".parquet") else csv.read_csv
        return tuple(read(path).to_pylist())
    with open(path) as f:
        return tuple(json.loads(line) for line in f if line.strip())


@functools.lru_cache(maxsize=8)
def _split(path: str, split: str, test_fraction: float,
           need: tuple[str, ...] = ("prompt", "answer")) -> tuple[dict, ...]:
    """`split`'s rows: a row's own "split" field, else a hash of its prompt (test: `test_fraction`
    of them), so no held-out row is ever a training row."""
    rows = _rows(path)
    bad = [i for i, r in enumerate(rows) if not set(need) <= set(r)]
    if not rows or bad:
        raise ValueError(f"{path}: expected rows with {', '.join(map(repr, need))} "
                         f"({'no rows' if not rows else f'row {bad[0]} lacks them'})")
    def side(row: dict) -> str:
        held = zlib.crc32(str(row[need[0]]).encode()) % 10_000 < test_fraction * 10_000
        return row.get("split", "test" if held else "train")
    rows = tuple(r for r in rows if side(r) == split)
    if not rows:
        raise ValueError(f"{path}: no '{split}' rows (test_fraction={test_fraction}, rows' "
                         "own 'split' field)")
    return rows


class MathProblems(Env):
    """Single-turn math: task i is row i (mod len) of `split` ("train" | "test") of a local JSONL
    file of {"prompt", "answer"} rows (e.g. DAPO-Math-17k converted once, offline); a row's
    "split" field places it, else a hash of its prompt puts `test_fraction` of the rows in test.
    Reward 1 if the reply's \\boxed{} answer equals the reference (the `math` reward, math-verify;
    plugin molt-reward-math)."""

    boxed = True          # the reply must box its answer
    def __init__(self, *, data: str, instruction: str = "", split: str = "train",
                 test_fraction: float = 0.1) -> None:
        self.rows, self.instruction = _split(data, split, test_fraction), instruction

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


class Arithmetic(MathProblems):
    """One-operation arithmetic word problems generated from the seed, split by a hash of
    (template, operands): "train" 4/5, "test" 1/5; math-verify on the reply's last number."""

    boxed = False
    # (text, answer); a, b drawn from `lo`..`hi`; division problems are built from their answer
    TEMPLATES = (
        ("{n} has {a} {x}. {n} buys {b} more {x}. How many {x} does {n} have now?", "a+b"),
        ("A shop had {a} {x}. It sold {b} of them. How many {x} are left?", "a-b"),
        ("There are {a} boxes with {b} {x} in each box. How many {x} are there in total?",
         "a*b"),
        ("{n} shares {a} {x} equally among {b} friends. How many {x} does each friend get?",
         "a/b"),
    )
    NAMES = ("Tom", "Anna", "Li", "Sara", "Omar", "Maya", "Ben", "Eva")
    ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "shells")

    def __init__(self, split: str = "train", lo: int = 2, hi: int = 60,
                 ops: str = "+-*/", instruction: str = "") -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split '{split}': use train or test")
        self.split, self.lo, self.hi, self.instruction = split, lo, hi, instruction
        self.templates = [t for t in self.TEMPLATES if t[1][1] in ops]
        if not self.templates or set(ops) - set("+-*/"):
            raise ValueError(f"ops '{ops}': use some of + - * /")

    async def reset(self, seed: int) -> Observation:
        rng = random.Random(seed)
        while True:
            text, op = rng.choice(self.templates)
            a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, min(self.hi, 12))
            if op == "a-b":
                a, b = max(a, b) + b, min(a, b)
            if op == "a/b":
                a = a * b
            key = zlib.crc32(f"{text}|{a}|{b}".encode()) % 5
            if (key == 0) == (self.split == "test"):
                break
        answer = {"a+b": a + b, "a-b": a - b, "a*b": a * b, "a/b": a // b}[op]
        self.row = {"answer": str(answer)}
        words = {"n": rng.choice(self.NAMES), "x": rng.choice(self.ITEMS), "a": a, "b": b}
        return text.format(**words) + self.instruction


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
    return None if value is None else float(value), info


class Dataset(Env):
    """Single turn: a row's `prompt` column (text or chat messages) is the observation; the reward
    is the weighted sum of `reward`'s functions (a name, a list or {name: weight}) of the reply and
    the row's columns. The train split is read in epochs, each shuffled by the run's seed."""

    def __init__(self, *, data: str, reward: str | list | dict, prompt: str = "prompt",
                 split: str = "train", test_fraction: float = 0.1, shuffle: bool = True) -> None:
        self.rows = _split(data, split, test_fraction, (prompt,))
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
        """Functions returning None are skipped; if all do, NaN (the rollout is dropped)."""
        columns = {k: v for k, v in self.row.items() if k != self.prompt}
        total, scored, info = 0.0, False, {"row": self.index}
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


class Colours(Env):
    """Name the colour of a generated noisy image by its letter (VL policies), a new image each
    of `turns` turns (rewards: docs/environments.md)."""

    RGB = {"r": (210, 40, 40), "g": (40, 190, 40), "b": (40, 40, 210), "y": (220, 210, 40),
           "w": (235, 235, 235), "k": (20, 20, 20)}

    def __init__(self, colours: str = "rgby", turns: int = 1, size: int = 32, noise: int = 30,
                 prompt: str = "") -> None:
        unknown = set(colours) - set(self.RGB)
        if unknown or not colours:
            raise ValueError(f"colours '{colours}': use letters of {''.join(self.RGB)}")
        self.colours, self.turns, self.size, self.noise, self.prompt = (colours, turns, size,
                                                                        noise, prompt)

    async def reset(self, seed: int) -> Observation:
        self.rng, self.turn, self.answers = np.random.default_rng(seed), 0, []
        return self._observe()

    def _observe(self) -> Observation:
        self.colour = self.colours[self.rng.integers(len(self.colours))]
        noise = self.rng.integers(-self.noise, self.noise + 1, (self.size, self.size, 3))
        image = np.clip(np.array(self.RGB[self.colour]) + noise, 0, 255).astype(np.uint8)
        parts = [{"type": "image", "image": image}]
        return [{"role": "user", "content": parts + ([{"type": "text", "text": self.prompt}]
                                                     if self.prompt else [])}]

    async def step(self, action: str) -> tuple[Observation | None, float, bool, dict]:
        first = action.strip()[:1]
        reward = 1.0 if first == self.colour else 0.1 if first and first in self.colours else 0.0
        self.answers.append(first == self.colour)
        self.turn += 1
        info = {"correct": sum(self.answers) / len(self.answers)}
        if self.turn >= self.turns:
            return None, reward / self.turns, True, info
        return self._observe(), reward / self.turns, False, info
