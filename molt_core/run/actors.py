"""Actors in the driver's process, for the embedded mode (no Ray daemons): Ray's calling
convention without Ray, so everything above the process boundary is one code path.

`LocalActor(cls, ...)` builds `cls` on a thread of its own running an event loop, as a Ray async
actor runs: `actor.method.remote(...)` schedules the call there and returns a `LocalRef`, which
is awaitable and taken by `get` / `wait` as an `ObjectRef` is by `ray.get` / `ray.wait`."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import ctypes
import functools
import inspect
import os
import queue
import sys
import threading
import types
from typing import Any, Callable

__all__ = ["DaemonExecutor", "LocalActor", "LocalRef", "get", "is_local", "release_threads", "wait"]


class DaemonExecutor(cf.ThreadPoolExecutor):
    """A loop's `asyncio.to_thread` pool (rewards, tools) of daemon threads, at most `workers`:
    the pool's own are joined at exit, so a reward blocked forever kept a failed or finished run
    alive (issue 41 item 12). Only the type is the pool's (asyncio requires it)."""

    def __init__(self, workers: int = min(32, (os.cpu_count() or 1) + 4)) -> None:
        super().__init__(workers)
        self._jobs, self._idle, self._left = queue.SimpleQueue(), threading.Semaphore(0), workers

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> cf.Future:
        self._jobs.put((fut := cf.Future(), fn, args, kwargs))
        if not self._idle.acquire(blocking=False) and self._left:
            self._left -= 1
            threading.Thread(target=self._work, daemon=True, name="molt-executor").start()
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args, kwargs = self._jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:      # as the pool's: the caller's to see
                    fut.set_exception(e)
            del fut, fn, args, kwargs
            self._idle.release()


class LocalRef:
    """The future value of one call on a `LocalActor`."""

    def __init__(self, future: cf.Future) -> None:
        self.future = future

    def __await__(self) -> Any:
        return asyncio.wrap_future(self.future).__await__()


class LocalActor:
    """`cls(*args, **kwargs)` on its own thread and event loop; calls run there, one at a time
    (coroutines interleave at their awaits)."""

    def __init__(self, cls: type, *args: Any, name: str = "", **kwargs: Any) -> None:
        self._name, self._loop = name or cls.__name__, asyncio.new_event_loop()
        self._busy = 0                      # calls in flight
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"molt-{self._name}")
        self._thread.start()
        try:    # built on its thread: what it sets per thread (torch's threads) stays its own
            self._instance = self._call(cls, args, kwargs).result()
        except BaseException:
            self.kill()
            raise

    def _call(self, fn: Callable, args: tuple, kwargs: dict) -> cf.Future:
        async def run() -> Any:
            self._busy += 1
            try:
                out = fn(*args, **kwargs)
                return await out if inspect.isawaitable(out) else out
            finally:                # the last call out lets its OpenMP team go
                self._busy -= 1
                if not self._busy:
                    release_threads()
        return asyncio.run_coroutine_threadsafe(run(), self._loop)   # cancel: the task's too

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._instance, name)      # AttributeError: `hasattr` as on Ray handles
        return types.SimpleNamespace(remote=lambda *a, **kw: LocalRef(self._call(method, a, kw)))

    def __repr__(self) -> str:
        return f"LocalActor({self._name})"

    def kill(self) -> None:
        """Cancel what runs on the actor's loop, stop it and its thread."""
        async def stop() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self._loop)
            self._thread.join(timeout=30)


def release_threads() -> None:
    """This thread's OpenMP workers exit (its next parallel op starts them again, ~0.1 ms). The
    engine's thread and the driver's trainer are two OpenMP teams: with more team threads than
    cores libgomp spins a few turns per join, then every op waits for a sleeping thread; one
    team alive at a time, sync mode runs as fast as alone (docs/benchmarks.md, "Two teams")."""
    if "torch" in sys.modules and (lib := _openmp()):
        lib.omp_pause_resource_all(1)           # omp_pause_soft: this thread's pool only


@functools.cache
def _openmp() -> Any:
    """torch's OpenMP runtime (libgomp, libomp, libiomp5) where /proc lists it, else None."""
    with contextlib.suppress(OSError):
        libs = {ln.split()[-1] for ln in open("/proc/self/maps") if "omp" in ln.rsplit("/")[-1]}
        return next((lib for lib in map(ctypes.CDLL, sorted(libs))
                     if hasattr(lib, "omp_pause_resource_all")), None)


def is_local(handles: list) -> bool:
    return bool(handles) and all(isinstance(h, LocalActor) for h in handles)


def get(refs: Any, timeout: float | None = None) -> Any:
    """`ray.get` of Ray refs or `LocalRef`s (a list: one deadline for all)."""
    many = isinstance(refs, list)
    listed = refs if many else [refs]
    if listed and not isinstance(listed[0], LocalRef):
        import ray
        return ray.get(refs, timeout=timeout)
    done, pending = wait(listed, len(listed), timeout)
    if pending:
        raise TimeoutError(f"{len(pending)} local actor call(s) did not finish within {timeout}s")
    return [r.future.result() for r in done] if many else done[0].future.result()


def wait(refs: list, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
    """`ray.wait` (`num_returns`: 1 or all): (those done, in `refs`' order; the others)."""
    if refs and not isinstance(refs[0], LocalRef):
        import ray
        return ray.wait(refs, num_returns=num_returns, timeout=timeout)
    done, _ = cf.wait([r.future for r in refs], timeout,
                      cf.ALL_COMPLETED if num_returns >= len(refs) else cf.FIRST_COMPLETED)
    ready = [r for r in refs if r.future in done][:num_returns]
    return ready, [r for r in refs if r not in ready]
