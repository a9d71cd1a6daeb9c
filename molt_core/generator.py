"""Runs agents against the rollout engines and emits complete prompt groups.

The generator owns one asyncio loop (on a background thread) where every rollout of every group
runs concurrently; engines batch the concurrent requests. It works in token space only: agents
receive `Completion`s (ids, behavior log-probs, versions) and build `Trajectory`s from them.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import structlog

from molt_core.config import Config
from molt_core.trajectory import Completion, InvariantError, Trajectory

__all__ = ["EngineClient", "Generator", "RolloutContext"]

log = structlog.get_logger("molt.generator")


class EngineClient:
    """Routes each request to the engine with the fewest outstanding requests."""

    def __init__(self, engines: list[Any], timeout_s: float) -> None:
        self.engines = engines
        self.timeout_s = timeout_s
        self.outstanding = [0] * len(engines)

    async def generate(self, prompt_ids: list[int], sampling: dict) -> Completion:
        i = min(range(len(self.engines)), key=self.outstanding.__getitem__)
        self.outstanding[i] += 1
        try:
            call = self.engines[i].generate.remote(list(prompt_ids), sampling)
            return await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine {i} did not answer a generate call within "
                               f"{self.timeout_s}s (engine.timeout_s)") from None
        finally:
            self.outstanding[i] -= 1


@dataclass
class RolloutContext:
    """What an agent gets for one rollout."""
    group_id: int
    rollout_id: int
    task: int                                   # task index: env seed or dataset row
    sampling: dict                              # explicit sampling params for the engine
    generate: Callable[..., Awaitable[Completion]]   # generate(prompt_ids, sampling=None)
    tokenizer: Any


class Generator:
    def __init__(self, agent: Any, engines: list[Any], cfg: Config, tokenizer: Any,
                 vocab_size: int) -> None:
        self.agent = agent
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.client = EngineClient(engines, cfg.engine.timeout_s)
        self.sampling = {**vars(cfg.sampling)}
        self.counters: Counter[str] = Counter()
        self._group_ids = itertools.count()
        self._vocab = vocab_size             # the model's, which may exceed len(tokenizer)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="molt-generator")
        self._thread.start()

    def task_of(self, group_id: int) -> int:
        return self.cfg.seed * 1_000_003 + group_id

    def submit(self, coro: Awaitable) -> Any:
        """Schedule a coroutine on the generator loop; returns a concurrent Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def generate(self, num_groups: int) -> list[list[Trajectory]]:
        """Blocking: run rollouts until `num_groups` complete groups are collected."""
        return self.submit(self.collect(num_groups)).result()

    async def collect(self, num_groups: int) -> list[list[Trajectory]]:
        out: list[list[Trajectory]] = []
        attempts = 0
        while len(out) < num_groups:
            need = num_groups - len(out)
            attempts += need
            if attempts > 4 * num_groups:
                raise RuntimeError(f"could not complete {num_groups} groups after {attempts} "
                                   f"attempts; drops so far: {dict(self.counters)}. The agent "
                                   "fails too often: see the agent_error events in the log")
            groups = await asyncio.gather(*(self.run_group(next(self._group_ids))
                                            for _ in range(need)))
            out += [g for g in groups if g is not None]
        return out

    async def run_group(self, group_id: int) -> list[Trajectory] | None:
        n = self.cfg.rollout.group_size
        results = await asyncio.gather(*(self.run_one(group_id, i) for i in range(n)))
        trajs = [t for t in results if t is not None]
        if len(trajs) < n:
            self.counters["rollout/dropped/incomplete_group"] += 1
            return None
        return trajs

    async def run_one(self, group_id: int, rollout_id: int) -> Trajectory | None:
        ctx = RolloutContext(group_id, rollout_id, self.task_of(group_id), dict(self.sampling),
                             self._generate, self.tokenizer)
        try:
            traj = await asyncio.wait_for(self.agent.rollout(ctx), self.cfg.agent.timeout_s)
        except InvariantError:
            raise
        except Exception as e:  # an agent bug drops this rollout, counted; the run goes on
            reason = "agent_timeout" if isinstance(e, asyncio.TimeoutError) else "agent_error"
            self.counters[f"rollout/dropped/{reason}"] += 1
            log.warning(reason, group=group_id, rollout=rollout_id, error=f"{type(e).__name__}: {e}")
            return None
        traj.group_id, traj.rollout_id = group_id, rollout_id
        traj.check(self._vocab)
        return traj

    async def _generate(self, prompt_ids: list[int], sampling: dict | None = None) -> Completion:
        return await self.client.generate(prompt_ids, sampling or self.sampling)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
