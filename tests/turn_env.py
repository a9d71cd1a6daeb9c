"""Test plugin: env `turn_letters`, a multi-turn task with a reward on every turn. Turn k shows
the digit k; the right reply is letters[k] (1/turns reward), a wrong one ends the episode, so
rollouts stop at different turns and only a turn's own reply and the ones after it earn its
credit. A random-init character model is right about 1 time in 60 per turn."""

from __future__ import annotations

from molt_core import hookimpl
from molt_gym.envs import Env


class TurnLetters(Env):
    def __init__(self, letters: str = "abc") -> None:
        self.letters = letters

    async def reset(self, seed: int) -> str:
        self.turn = 0
        return "0"

    async def step(self, action: str) -> tuple[str | None, float, bool, dict]:
        right = action.strip()[:1] == self.letters[self.turn]
        self.turn += 1
        done = not right or self.turn == len(self.letters)
        info = {"turns": self.turn, "solved": right and done}
        return (None if done else str(self.turn)), right / len(self.letters), done, info


@hookimpl
def molt_envs() -> dict:
    return {"turn_letters": TurnLetters}
