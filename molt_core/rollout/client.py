"""The engine client: batched RPCs, load spreading, timeouts, aborts, re-sent requests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from typing import Any

import ray
import structlog

from molt_core.trajectory import Completion, ImageInput

__all__ = ["EngineClient", "EngineDied"]

log = structlog.get_logger("molt.generator")
HEARTBEAT_S = 60.0      # a call unanswered this long is said, before engine.timeout_s ends it


class EngineDied(RuntimeError):
    """A request's engine died; with `EngineClient.reissue` the request goes out again."""


class EngineClient:
    """Sends requests to the engines: requests made within `window_s` of each other travel in
    one `generate_batch` RPC per engine (one Ray call per request costs more than the decode of
    a tiny model), spread over the engines by outstanding load. With `reissue`, an engine that
    dies goes into `dead` ({index: cause}) and its requests go out again (else they fail)."""

    def __init__(self, engines: list[Any], timeout_s: float, window_s: float = 0.002) -> None:
        self.engines, self.timeout_s, self.window_s = engines, timeout_s, window_s
        self.outstanding = [0] * len(engines)
        self._pending: list[tuple[list[int], dict, list[ImageInput], asyncio.Future]] = []
        self._ids = (f"{id(self):x}-{i}" for i in itertools.count())
        self._sent: dict[asyncio.Future, tuple[int, str]] = {}   # -> (engine, request id)
        self.aborts: set[asyncio.Task] = set()
        self.active = 0                          # generate calls sent and not yet answered
        self.reissue = False
        self.dead: dict[int, str] = {}
        self._held = False                       # by `hold`: new requests wait
        self._gate: asyncio.Event | None = None  # cleared when held or no engine is alive
        self._busy = [0.0] * len(engines)        # seconds each engine had requests in flight
        self._since = [0.0] * len(engines)

    async def generate(self, prompt_ids: list[int], sampling: dict,
                       images: list[ImageInput] | None = None) -> Completion:
        while True:
            while self._gate is not None and not self._gate.is_set():
                await self._gate.wait()
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._pending.append((list(prompt_ids), sampling, list(images or []), fut))
            if len(self._pending) == 1:
                loop.call_later(self.window_s, self._flush)
            self.active += 1
            try:
                return await fut
            except EngineDied:
                continue
            finally:
                self.active -= 1
                if fut.cancelled() and fut in self._sent:  # the rollout gave up: stop it there too
                    self._abort(*self._sent.pop(fut))

    def _abort(self, i: int, *request_ids: str) -> None:
        async def abort() -> None:
            try:
                await asyncio.wait_for(self.engines[i].abort.remote(list(request_ids)),
                                       self.timeout_s)
            except Exception as e:  # the engine is gone or stuck: nothing left to stop
                log.warning("abort_failed", engine=i, error=f"{type(e).__name__}: {e}")
        task = asyncio.ensure_future(abort())
        self.aborts.add(task)
        task.add_done_callback(self.aborts.discard)

    async def hold(self) -> None:
        """Let requests already sent finish; new ones wait until `release`."""
        self.release(held=True)
        while self.active:
            await asyncio.sleep(0.002)

    def release(self, held: bool = False) -> None:
        """Open the gate (`held`: close it); it stays closed while every engine is dead."""
        self._held = held
        self._gate = self._gate or asyncio.Event()
        self._gate.clear() if held or len(self.dead) == len(self.engines) else self._gate.set()

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        chunks: list[list] = [[] for _ in self.engines]
        live = [j for j in range(len(self.engines)) if j not in self.dead]
        for req in batch:
            if not live:        # every engine died: the request goes out again once one is back
                req[3].done() or req[3].set_exception(EngineDied("no live engine"))
                continue
            i = min(live, key=lambda j: self.outstanding[j] + len(chunks[j]))
            chunks[i].append(req)
        for i, chunk in enumerate(chunks):
            if chunk:
                asyncio.ensure_future(self._send(i, chunk))

    def busy_s(self) -> float:
        """Mean seconds per engine with requests in flight since the last call (async too)."""
        now = time.perf_counter()
        for i, n in enumerate(self.outstanding):
            if n:
                self._busy[i], self._since[i] = self._busy[i] + now - self._since[i], now
        busy, self._busy = self._busy, [0.0] * len(self.engines)
        return sum(busy) / max(len(busy), 1)

    async def _answer(self, i: int, call: Any) -> Any:
        """`call`'s result within `timeout_s`; each `HEARTBEAT_S` before, a warning with engine
        `i`'s requests in flight and the machine's load (a starved box looks like a hung engine)."""
        task, waited = asyncio.ensure_future(call), HEARTBEAT_S
        while waited < self.timeout_s:
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(asyncio.shield(task), HEARTBEAT_S)
            log.warning("engine_slow", engine=i, unanswered_s=waited, timeout_s=self.timeout_s,
                        requests=self.outstanding[i], load=os.getloadavg(), cpus=os.cpu_count())
            waited += HEARTBEAT_S
        return await asyncio.wait_for(task, self.timeout_s - waited + HEARTBEAT_S)

    async def _send(self, i: int, chunk: list) -> None:
        chunk = [c for c in chunk if not c[3].cancelled()]     # given up before it was sent
        if not chunk:
            return
        if not self.outstanding[i]:
            self._since[i] = time.perf_counter()
        self.outstanding[i] += len(chunk)
        ids = [next(self._ids) for _ in chunk]
        engine = self.engines[i]
        self._sent.update((fut, (i, rid)) for (*_, fut), rid in zip(chunk, ids))
        try:
            # Images only where some request has them: text-only engines keep their signature.
            images = {"images": [im for _, _, im, _ in chunk]} if any(c[2] for c in chunk) else {}
            # One timeout per RPC, not per request (a wait_for per request costs ~0.1 ms).
            outs = await self._answer(i, engine.generate_batch.remote(
                [p for p, _, _, _ in chunk], [s for _, s, _, _ in chunk], **images,
                request_ids=ids))
        except asyncio.TimeoutError:
            self._abort(i, *ids)
            outs = [TimeoutError(f"no engine answered a generate call within {self.timeout_s}s "
                                 "(engine.timeout_s)")] * len(chunk)
        except Exception as e:  # the engine died: every request of the chunk fails with it
            died = self.reissue and isinstance(e, ray.exceptions.RayActorError)
            if died and engine is self.engines[i]:      # not yet replaced
                self.dead[i] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                self.release(self._held)
            outs = [(EngineDied if died else RuntimeError)(
                f"engine {i} failed: {type(e).__name__}: {e}")] * len(chunk)
        finally:
            self.outstanding[i] -= len(chunk)
            for *_, fut in chunk:
                self._sent.pop(fut, None)
            if not self.outstanding[i]:
                self._busy[i] += time.perf_counter() - self._since[i]
        for (_, _, _, fut), out in zip(chunk, outs):
            if not fut.done():
                fut.set_exception(out) if isinstance(out, Exception) else fut.set_result(out)
