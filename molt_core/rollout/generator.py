"""Runs agents against the rollout engines, all rollouts at once on an asyncio loop of its own
(a thread), and emits complete prompt groups: `generate(n)` n fresh ones (sync scheme), or the
streaming pool (`start_pool(k)`, `take(n)`), which keeps k running or waiting (async, partial)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import math
import threading
from collections import Counter
from concurrent import futures
from typing import Any, Awaitable, Callable

import structlog

from molt_core.config import Config
from molt_core.contracts import RolloutContext
from molt_core.rollout.client import EngineClient
from molt_core.trajectory import Completion, ImageInput, InvariantError, Trajectory

__all__ = ["AbsurdReward", "FailureRateError", "Generator", "NonFiniteReward", "filter_stale",
           "version_lag_metrics"]

log = structlog.get_logger("molt.generator")


# |reward| above this is a bug upstream, not a signal: it would swamp the batch's statistics
MAX_ABS_REWARD = 1e6
_CHAINED = contextvars.ContextVar("molt_chained", default=False)   # in a deterministic batch


class NonFiniteReward(ValueError):
    """A rollout's reward is NaN, inf, not a number or |r| > MAX_ABS_REWARD: dropped, counted."""


class AbsurdReward(NonFiniteReward):
    """A finite reward with |r| > MAX_ABS_REWARD."""


class FailureRateError(RuntimeError):
    """More rollouts failed than `agent.max_failure_rate` allows."""


class Generator:
    def __init__(self, agent: Any, engines: list[Any], cfg: Config, tokenizer: Any, vocab_size: int,
                 task_of: Callable[[int], int] | None = None, seeded: bool = False) -> None:
        """`seeded`: each engine call carries a seed of its own, from its task, rollout and call
        index (eval: it never draws from, nor shares a wave with, the training stream)."""
        self.agent, self.cfg, self.tokenizer, self.seeded = agent, cfg, tokenizer, seeded
        self.task_of = task_of or self.task_of       # group id -> task (eval: its own tasks)
        self.client = EngineClient(engines, cfg.engine.timeout_s)
        self.sampling = {**vars(cfg.sampling)}
        self.counters: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()      # failed rollouts' messages
        self._next_group = 0                  # the task cursor: group ids are handed out in order
        self._reissue: list[int] = []         # resumed: in-flight groups to run again first
        self._vocab = vocab_size             # the model's, which may exceed len(tokenizer)
        self._pool_cap = 0                    # streaming pool: 0 = not started
        self._pool_open = False
        self._buffer: list[list[Trajectory]] = []    # finished groups, in completion order
        self._inflight: dict[asyncio.Task, int] = {}   # running group -> its id
        self._pool_error: BaseException | None = None
        self._failed_in_a_row = 0
        self._changed: asyncio.Event | None = None
        self._revive: Callable[[dict[int, str]], None] | None = None   # see on_engine_death
        self.on_group_done: Callable[[list[Trajectory]], None] | None = None   # eval's progress
        self._batch, self._avail, self._lag = 0, 0, 0   # deterministic pool (advance)
        self._running: asyncio.Task | None = None        # its batch being generated
        self._split, self._live, self._parked = False, 0, 0   # partial: rollouts running, parked
        self._resumed = asyncio.Event()                  # cleared: calls stop at their split
        self._resumed.set()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="molt-generator")
        self._thread.start()

    def task_of(self, group_id: int) -> int:     # training's tasks
        return self.cfg.seed * 1_000_003 + group_id

    def new_group_id(self) -> int:
        if self._reissue:
            return self._reissue.pop(0)
        self._next_group += 1
        return self._next_group - 1

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

    def on_engine_death(self, revive: Callable[[dict[int, str]], None]) -> None:
        """From now on a dead engine's requests go out again, and `revive(dead)` ({index: cause})
        replaces the engines, called on the driver's thread while it waits for rollouts."""
        self._revive, self.client.reissue = revive, True

    def submit(self, coro: Awaitable) -> Any:
        """Schedule a coroutine on the generator loop; returns a concurrent Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def generate(self, num_groups: int) -> list[list[Trajectory]]:
        """Blocking: run rollouts until `num_groups` complete groups are collected."""
        return self._wait(self.submit(self.collect(num_groups)))

    def _wait(self, fut: futures.Future) -> Any:
        """`fut`'s result; engines that die meanwhile are replaced here, on the driver's thread."""
        while not futures.wait([fut], timeout=1.0).done:
            if self.client.dead and self._revive is not None:
                self._revive(dict(self.client.dead))
        return fut.result()

    async def collect(self, num_groups: int) -> list[list[Trajectory]]:
        out: list[list[Trajectory]] = []
        attempts = 0
        while len(out) < num_groups:
            need = num_groups - len(out)
            attempts += need
            if attempts > 4 * num_groups:
                raise self._stuck(f"could not complete {num_groups} groups after {attempts} "
                                  "attempts")
            groups = await asyncio.gather(*(self.run_group(self.new_group_id())
                                            for _ in range(need)), return_exceptions=True)
            if errors := [g for g in groups if isinstance(g, BaseException)]:
                raise errors[0]     # each group's error retrieved: no "never retrieved" noise
            out += [g for g in groups if g is not None]
        return out

    def _stuck(self, what: str) -> RuntimeError:
        common = "".join(f"; the commonest error ({n}x): {e}"
                         for e, n in self._errors.most_common(1))
        return FailureRateError(f"{what}; drops so far: {dict(self.counters)}{common}. The agent "
                                "fails too often: see the agent_error events in the log")

    def start_pool(self, max_groups: int) -> None:
        """Keep up to `max_groups` groups running or finished-and-waiting from now on."""
        self.submit(self._start_pool(max_groups)).result()

    def advance(self, version: int, groups: int, lag: int, split: bool = False) -> None:
        """The deterministic pool (`take` as from the streaming pool): batch j, `groups` groups
        generated as `generate` does, one batch at a time, starts once `version` >= j - lag is
        on the engines, so timing never decides which weights sample it. `split` (partial): each
        engine call of batch j stops after half its max_new_tokens until version j - lag + 1
        is, then goes on under it (j < lag: at once, under version 0)."""
        async def go() -> None:
            self._pool_cap, self._lag, self._chain_n = groups * (lag + 1), lag, groups
            self._split, self._changed = split, self._changed or asyncio.Event()
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
        """Blocking: let every engine request already sent finish; new ones wait for
        `release_requests` (a weight push in between then never splits a response)."""
        self.submit(self.client.hold()).result()

    def release_requests(self) -> None:
        self.loop.call_soon_threadsafe(self.client.release)

    async def _start_pool(self, max_groups: int) -> None:
        self._pool_cap, self._pool_open, self._changed = max_groups, True, asyncio.Event()
        self._refill()

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

    async def run_group(self, group_id: int) -> list[Trajectory] | None:
        n = self.cfg.rollout.group_size
        self.counters["rollout/started_groups"] += 1
        # the rollouts start together: one group deadline is each one's agent.timeout_s (one timer)
        tasks = [asyncio.ensure_future(self.run_one(group_id, i)) for i in range(n)]
        try:
            _, late = await asyncio.wait(tasks, timeout=self.cfg.agent.timeout_s)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        for t in late:
            t.cancel()
            self._failed("agent_timeout", group_id, -1, f"no result within "
                         f"{self.cfg.agent.timeout_s}s (agent.timeout_s)")
        if errors := [e for t in tasks if t not in late and (e := t.exception())]:
            raise errors[0]         # the others' retrieved too
        trajs = [r for t in tasks if t not in late and (r := t.result()) is not None]
        if len(trajs) < min(n, 2):           # a group of one has no baseline to compare with
            self.counters["rollout/dropped/incomplete_group"] += 1
            return None
        if len(trajs) < n:                   # failed rollouts are dropped alone
            self.counters["rollout/smaller_groups"] += 1
        self.counters["rollout/finished_groups"] += 1
        if self.on_group_done is not None:
            self.on_group_done(trajs)
        return trajs

    async def run_one(self, group_id: int, rollout_id: int) -> Trajectory | None:
        task = self.task_of(group_id)
        gen = self._seeded(task, rollout_id) if self.seeded else self._generate
        ctx = RolloutContext(group_id, rollout_id, task, dict(self.sampling), gen, self.tokenizer)
        self.counters["rollout/attempted"] += 1
        self._live += 1
        try:
            traj = await self.agent.rollout(ctx)
            rewards = [float(r) for r in (traj.reward, *(traj.turn_rewards or []))]
            if not all(abs(r) <= MAX_ABS_REWARD for r in rewards):
                kind = AbsurdReward if all(map(math.isfinite, rewards)) else NonFiniteReward
                a = self.cfg.agent.args
                inner = "".join(f" {k} '{a[k]}'" for k in ("env", "agent") if k in a)
                raise kind(f"agent '{self.cfg.agent.name}'{inner} returned reward {traj.reward!r} (turn "
                           f"rewards {traj.turn_rewards}) for task {ctx.task}; rewards must be "
                           f"finite and within ±{MAX_ABS_REWARD:g} (generator.MAX_ABS_REWARD)")
        except (InvariantError, asyncio.CancelledError):
            raise
        except BaseException as e:  # SystemExit/KeyboardInterrupt in an env too: never the loop
            reason = {NonFiniteReward: "nonfinite_reward", AbsurdReward: "absurd_reward"}.get(
                type(e), "agent_error")
            self._failed(reason, group_id, rollout_id, f"{type(e).__name__}: {e}")
            return None
        finally:
            self._live -= 1
        traj.group_id, traj.rollout_id = group_id, rollout_id
        traj.check(self._vocab)
        return traj

    def _failed(self, reason: str, group_id: int, rollout_id: int, error: str) -> None:
        """Count a dropped rollout; past `agent.max_failure_rate` the run stops, naming the
        commonest error."""
        self.counters[f"rollout/dropped/{reason}"] += 1
        self.counters["rollout/failed"] += 1
        self._errors[error[:300]] += 1
        log.warning(reason, group=group_id, rollout=rollout_id, error=error)
        failed, tried = self.counters["rollout/failed"], self.counters["rollout/attempted"]
        if tried >= 2 * self.cfg.rollout.group_size and \
                failed / tried > self.cfg.agent.max_failure_rate:
            (common, times), = self._errors.most_common(1)
            raise FailureRateError(
                f"{failed} of {tried} rollouts failed (> agent.max_failure_rate="
                f"{self.cfg.agent.max_failure_rate}); the commonest error ({times}x): {common}")

    async def _generate(self, prompt_ids: list[int], sampling: dict | None = None,
                        images: list[ImageInput] | None = None) -> Completion:
        s = sampling or self.sampling
        if self._resumed.is_set() or not _CHAINED.get() or s["max_new_tokens"] < 2:  # `advance`
            return await self.client.generate(prompt_ids, s, images)
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

    def _seeded(self, task: int, rollout_id: int) -> Callable[..., Awaitable[Completion]]:
        calls = itertools.count()

        async def generate(prompt_ids: list[int], sampling: dict | None = None,
                           images: list[ImageInput] | None = None) -> Completion:
            seed = hash((self.cfg.seed, task, rollout_id, next(calls))) % 2**63
            return await self._generate(prompt_ids, {**(sampling or self.sampling),
                                                     "seed": seed}, images)
        return generate

    def close(self) -> None:
        """Cancel the running groups, let the agent release what it holds on this loop (its
        `aclose()`, if it has one: the chat agent's server), stop the loop."""
        closing = ([self._cancel_all()] if self._inflight or self._running else []) + (
            [self.agent.aclose()] if hasattr(self.agent, "aclose") else [])
        for coro in closing:
            with contextlib.suppress(Exception):  # closing anyway
                self.submit(coro).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def filter_stale(groups: list[list[Trajectory]], version: int, max_staleness: int, mode: str,
                 counters: Counter) -> list[list[Trajectory]]:
    """Invariant 2: no trainable token sampled more than `max_staleness` versions before
    `version` (the weights being trained) survives. mode "drop": a group holding such a token is
    dropped whole (`rollout/dropped/stale_group`); "mask": those tokens become untrainable
    (`rollout/masked/stale_tokens`; they keep their version for audit) and the group stays."""
    out = []
    for g in groups:
        stale = [[m and version - v > max_staleness for m, v in zip(t.loss_mask, t.versions)]
                 for t in g]
        n_stale = sum(map(sum, stale))
        if n_stale and mode == "drop":
            counters["rollout/dropped/stale_group"] += 1
            continue
        if n_stale:
            counters["rollout/masked/stale_tokens"] += n_stale
            for t, s in zip(g, stale):
                t.loss_mask = [m and not x for m, x in zip(t.loss_mask, s)]
        out.append(g)
    return out


def version_lag_metrics(trajs: list[Trajectory], version: int) -> dict[str, float]:
    """Distribution of `version - token version` over trainable tokens: mean, max and the
    fraction of tokens at each lag (`rollout/version_lag/k`); the fraction of trajectories
    sampled by more than one version (`rollout/multi_version`: partial rollout)."""
    trained = [list(itertools.compress(t.versions, t.loss_mask)) for t in trajs]
    lags = {version - v: c for v, c in Counter(itertools.chain.from_iterable(trained)).items()}
    if not (n := sum(lags.values())):
        return {}
    return {"rollout/version_lag_mean": sum(k * c for k, c in lags.items()) / n,
            "rollout/version_lag_max": float(max(lags)),
            "rollout/multi_version": sum(len(set(vs)) > 1 for vs in trained) / len(trajs),
            **{f"rollout/version_lag/{k}": c / n for k, c in sorted(lags.items())}}
