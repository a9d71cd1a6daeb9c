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
    """Sends requests to the engines: requests made within `window_s` of each other travel in
    one `generate_batch` RPC per engine (one Ray call per request costs more than the decode of
    a tiny model), spread over the engines by outstanding load."""

    def __init__(self, engines: list[Any], timeout_s: float, window_s: float = 0.002) -> None:
        self.engines = engines
        self.timeout_s = timeout_s
        self.window_s = window_s
        self.outstanding = [0] * len(engines)
        self._pending: list[tuple[list[int], dict, asyncio.Future]] = []

    async def generate(self, prompt_ids: list[int], sampling: dict) -> Completion:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((list(prompt_ids), sampling, fut))
        if len(self._pending) == 1:
            loop.call_later(self.window_s, self._flush)
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no engine answered a generate call within {self.timeout_s}s "
                               "(engine.timeout_s)") from None

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        chunks: list[list] = [[] for _ in self.engines]
        for req in batch:
            i = min(range(len(self.engines)), key=lambda j: self.outstanding[j] + len(chunks[j]))
            chunks[i].append(req)
        for i, chunk in enumerate(chunks):
            if chunk:
                asyncio.ensure_future(self._send(i, chunk))

    async def _send(self, i: int, chunk: list) -> None:
        self.outstanding[i] += len(chunk)
        try:
            outs = await self.engines[i].generate_batch.remote([p for p, _, _ in chunk],
                                                              [s for _, s, _ in chunk])
        except Exception as e:  # the engine died: every request of the chunk fails with it
            outs = [RuntimeError(f"engine {i} failed: {type(e).__name__}: {e}")] * len(chunk)
        finally:
            self.outstanding[i] -= len(chunk)
        for (_, _, fut), out in zip(chunk, outs):
            if not fut.done():
                fut.set_exception(out) if isinstance(out, Exception) else fut.set_result(out)


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
