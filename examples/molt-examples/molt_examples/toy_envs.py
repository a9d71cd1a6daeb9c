"""The toy environments the CPU recipes learn (registered by `molt_examples` for the gym agent,
with its `Env` contract; rewards: docs/environments.md, "Shipped environments")."""

from __future__ import annotations

import random
import string
import zlib

import numpy as np

from molt_core.contracts import Env, Observation
from molt_gym.envs import MathProblems

__all__ = ["Addition", "Arithmetic", "Colours", "GuessNumber", "NextLetter", "Spell"]


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
