"""The `Env` interface and the toy environments the CPU recipes learn."""

from __future__ import annotations

import random
import string

__all__ = ["Env", "GuessNumber", "NextLetter", "Observation"]

Observation = str | list[dict]   # a user message, or chat messages


class Env:
    """One instance per rollout. Override `reset` and `step`."""

    async def reset(self, seed: int) -> Observation:
        """Start an episode for task `seed`; return the first observation."""
        raise NotImplementedError

    async def step(self, action: str) -> tuple[Observation | None, float, bool, dict]:
        """Apply the policy's reply; return (observation, reward, done, info)."""
        raise NotImplementedError


class NextLetter(Env):
    """"after c" -> "d". Single turn, judged on the reply's first character.

    Reward: 1 for the right letter; a near miss (distance d < window) earns 0.1 + 0.5 (1 - d/window);
    any other letter 0.1 (format credit); anything else 0.
    """

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


class GuessNumber(Env):
    """Guess a digit in [lo, hi] with "higher"/"lower" feedback. Multi-turn.

    Reward 1 on the turn the guess is right (0 otherwise), so fewer turns need a better first
    guess; an invalid reply ends the episode.
    """

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
