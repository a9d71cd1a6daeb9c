"""Test plugin: env `flaky_letter`, NextLetter whose n-th step (counted over the process)
misbehaves by a fixed schedule: SystemExit, KeyboardInterrupt, a NaN reward, and every 10th
step a RuntimeError (10 % failing rollouts)."""

from __future__ import annotations

import itertools

from molt_core import hookimpl
from molt_examples import NextLetter

_calls = itertools.count(1)


class FlakyLetter(NextLetter):
    async def step(self, action: str):
        n = next(_calls)
        if n == 3:
            raise SystemExit(3)
        if n == 7:
            raise KeyboardInterrupt
        if n % 10 == 0:
            raise RuntimeError("flaky env broke")
        obs, reward, done, info = await super().step(action)
        return obs, float("nan") if n == 5 else reward, done, info


@hookimpl
def molt_envs():
    return {"flaky_letter": FlakyLetter}
