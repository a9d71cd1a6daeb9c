"""Runs agents against the rollout engines, all rollouts at once on an asyncio loop of its own
(a thread), and emits complete prompt groups: `generate(n)` n fresh ones (sync scheme, eval); the
pools of the async and partial schemes are `rollout.pool.PooledGenerator`'s."""

from __future__ import annotations

import asyncio
import contextlib
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
from molt_core.run.actors import DaemonExecutor
from molt_core.trajectory import Completion, ImageInput, InvariantError, Trajectory

__all__ = ["AbsurdReward", "FailureRateError", "Generator", "NonFiniteReward", "filter_stale",
           "version_lag_metrics"]

log = structlog.get_logger("molt.generator")


# |reward| above this is a bug upstream, not a signal: it would swamp the batch's statistics
MAX_ABS_REWARD = 1e6


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
        self._revive: Callable[[dict[int, str]], None] | None = None   # see on_engine_death
        self.on_group_done: Callable[[list[Trajectory]], None] | None = None   # eval's progress
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(DaemonExecutor())   # a blocked reward: no hang at exit
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
        return await self.client.generate(prompt_ids, sampling or self.sampling, images)

    def _seeded(self, task: int, rollout_id: int) -> Callable[..., Awaitable[Completion]]:
        calls = itertools.count()

        async def generate(prompt_ids: list[int], sampling: dict | None = None,
                           images: list[ImageInput] | None = None) -> Completion:
            seed = hash((self.cfg.seed, task, rollout_id, next(calls))) % 2**63
            return await self._generate(prompt_ids, {**(sampling or self.sampling),
                                                     "seed": seed}, images)
        return generate

    def close(self) -> None:
        """Let the agent release what it holds on this loop (its `aclose()`, if it has one: the
        chat agent's server), stop the loop."""
        if hasattr(self.agent, "aclose"):
            with contextlib.suppress(Exception):  # closing anyway
                self.submit(self.agent.aclose()).result(timeout=5)
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
