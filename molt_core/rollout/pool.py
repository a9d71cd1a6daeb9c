"""The run's generator, a `contracts.RolloutGenerator`: the core `Generator` with the pools of the
async and partial schemes, streaming (`start_pool(k)`, `take(n)`: k groups running or waiting) and
deterministic (`advance`, `drain`: batch j once its version is on the engines)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import Counter
from typing import Any

from molt_core.rollout.generator import Generator
from molt_core.trajectory import Completion, ImageInput, Trajectory

__all__ = ["PooledGenerator"]

_CHAINED = contextvars.ContextVar("molt_chained", default=False)   # in a deterministic batch


class PooledGenerator(Generator):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool_cap, self._pool_open, self._failed_in_a_row = 0, False, 0   # 0: not started
        self._buffer: list[list[Trajectory]] = []      # finished groups, in completion order
        self._inflight: dict[asyncio.Task, int] = {}     # running group -> its id
        self._pool_error: BaseException | None = None
        self._changed = asyncio.Event()                  # a group finished or failed
        self._batch, self._avail, self._lag = 0, 0, 0   # deterministic pool (advance)
        self._running: asyncio.Task | None = None        # its batch being generated
        self._split, self._live, self._parked = False, 0, 0   # partial: rollouts running, parked
        self._resumed = asyncio.Event()                  # cleared: calls stop at their split
        self._resumed.set()

    def state_dict(self) -> dict[str, Any]:
        """Task cursor, counters and the pool: finished groups and the ids of running ones."""
        async def snap() -> dict[str, Any]:
            self._resumed.set()              # a save follows a push: a parked batch goes on
            while self._running is not None:      # deterministic pool: whole batches
                await asyncio.wait([self._running])
            return {"next_group": self._next_group, "counters": dict(self.counters),
                    "buffer": list(self._buffer), "batch": self._batch,
                    "reissue": self._reissue + sorted(self._inflight.values())}
        return self.submit(snap()).result()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: groups started before this (a pool opened by the scheme) are cancelled; the
        checkpoint's running groups run again with the same ids (hence tasks) before new ones."""
        async def load() -> None:
            tasks = list(self._inflight)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._next_group, self._reissue = state["next_group"], list(state["reissue"])
            self.counters = Counter(state["counters"])
            self._buffer, self._batch = list(state["buffer"]), state.get("batch", 0)
            if self._pool_cap:
                self._refill()
        self.submit(load()).result()

    def start_pool(self, max_groups: int) -> None:
        async def start() -> None:
            self._pool_cap, self._pool_open = max_groups, True
            self._refill()
        self.submit(start()).result()

    def advance(self, version: int, groups: int, lag: int, split: bool = False) -> None:
        """The deterministic pool (`take` as from the streaming pool): batch j, `groups` groups
        generated as `generate` does, one batch at a time, starts once `version` >= j - lag is
        on the engines, so timing never decides which weights sample it. `split` (partial): each
        engine call of batch j stops after half its max_new_tokens until version j - lag + 1
        is, then goes on under it (j < lag: at once, under version 0)."""
        async def go() -> None:
            self._pool_cap, self._lag, self._chain_n = groups * (lag + 1), lag, groups
            self._split = split
            self._advance(version)
        self.submit(go()).result()

    def drain(self) -> None:
        """Blocking: the deterministic pool's batches finished or, split, each running rollout
        parked at its split (none goes on or starts until `advance`)."""
        async def wait() -> None:
            while self._running is not None and not 0 < self._live == self._parked:
                await asyncio.wait([self._running], timeout=0.002)
        self._wait(self.submit(wait()))

    def _advance(self, version: int) -> None:
        self._avail = version
        if self._running is None and version >= self._batch - self._lag:
            ctx = contextvars.copy_context()
            ctx.run(_CHAINED.set, True)        # its engine calls (only theirs) may be split
            self._running = self.loop.create_task(self.collect(self._chain_n), context=ctx)
            self._running.add_done_callback(self._batch_done)
        if self._split and version <= self._batch - self._lag:  # the running batch's next version
            self._resumed.clear()                                # is not on the engines yet
        else:
            self._resumed.set()

    def _batch_done(self, task: asyncio.Task) -> None:
        self._running = None
        if task.cancelled():
            return
        if task.exception() is not None:
            self._pool_error = self._pool_error or task.exception()
        else:
            self._buffer += task.result()
            self._batch += 1
            self._advance(self._avail)
        self._changed.set()

    def take(self, n: int) -> list[list[Trajectory]]:
        """Blocking: the first `n` finished groups (oldest first); the rest stay in the pool."""
        return self._wait(self.submit(self._take(n)))

    def stop_pool(self) -> None:
        """Start no new groups and wait for the running ones (they stay available to `take`)."""
        self.submit(self._stop_pool()).result()

    def pool_state(self) -> dict[str, int]:
        return {"buffered": len(self._buffer), "inflight": len(self._inflight)}

    def hold_requests(self) -> None:
        """Blocking (`contracts.RolloutGenerator`); a push before the release splits no reply."""
        self.submit(self.client.hold()).result()

    def release_requests(self) -> None:
        self.loop.call_soon_threadsafe(self.client.release)

    def _refill(self) -> None:
        while self._pool_open and len(self._inflight) + len(self._buffer) < self._pool_cap:
            gid = self.new_group_id()
            task = asyncio.ensure_future(self.run_group(gid))
            self._inflight[task] = gid
            task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task) -> None:
        self._inflight.pop(task, None)
        if task.cancelled():
            return
        if task.exception() is not None:          # an invariant violation: the run must stop
            self._pool_error = self._pool_error or task.exception()
        elif task.result() is None:               # dropped, counted by run_group
            self._failed_in_a_row += 1
            if self._failed_in_a_row > 4 * self._pool_cap:
                self._pool_error = self._stuck(f"{self._failed_in_a_row} groups in a row could "
                                               "not complete")
        else:
            self._failed_in_a_row = 0
            self._buffer.append(task.result())
        self._changed.set()
        self._refill()

    async def _take(self, n: int) -> list[list[Trajectory]]:
        if not self._pool_cap:
            raise RuntimeError("take() before start_pool()")
        if n > self._pool_cap:
            raise ValueError(f"take({n}) from a pool of at most {self._pool_cap} groups")
        while len(self._buffer) < n:
            if self._pool_error is not None:
                raise self._pool_error
            if not self._inflight and not self._pool_open and self._running is None:
                raise RuntimeError(f"take({n}): the pool is stopped with {len(self._buffer)} "
                                   "finished groups")
            self._changed.clear()
            await self._changed.wait()
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        self._refill()
        return out

    async def _stop_pool(self) -> None:
        self._pool_open = False
        await asyncio.gather(*self._inflight, return_exceptions=True)

    async def _cancel_all(self) -> None:
        self._pool_open, tasks = False, [*self._inflight, *[self._running] * bool(self._running)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self.client.aborts, return_exceptions=True)

    async def run_one(self, group_id: int, rollout_id: int) -> Trajectory | None:
        self._live += 1                  # the one count of running rollouts (drain's)
        try:
            return await super().run_one(group_id, rollout_id)
        finally:
            self._live -= 1

    async def _generate(self, prompt_ids: list[int], sampling: dict | None = None,
                        images: list[ImageInput] | None = None) -> Completion:
        s = sampling or self.sampling
        if self._resumed.is_set() or not _CHAINED.get() or s["max_new_tokens"] < 2:  # `advance`
            return await super()._generate(prompt_ids, s, images)
        k = s["max_new_tokens"] // 2
        a = await self.client.generate(prompt_ids, {**s, "max_new_tokens": k}, images)
        if a.finish_reason != "length" or len(a.token_ids) < k:
            return a
        self._parked += 1
        try:
            await self._resumed.wait()
        finally:
            self._parked -= 1
        b = await self.client.generate(prompt_ids + a.token_ids,
                                       {**s, "max_new_tokens": s["max_new_tokens"] - k}, images)
        n, pr = len(prompt_ids), b.prompt_routed_experts    # routing: the continuation's prefill
        return Completion(a.token_ids + b.token_ids, a.logprobs + b.logprobs,
                          a.versions + b.versions, b.finish_reason,
                          pr and pr[n:] + b.routed_experts, pr and pr[:n])

    def close(self) -> None:
        """Cancel the running groups, then `Generator.close`."""
        if self._inflight or self._running:
            with contextlib.suppress(Exception):  # closing anyway
                self.submit(self._cancel_all()).result(timeout=5)
        super().close()
