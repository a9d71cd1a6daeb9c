"""Actors in the driver's process, for the embedded mode (no Ray daemons): Ray's calling
convention without Ray, so everything above the process boundary is one code path.

`LocalActor(cls, ...)` builds `cls` on a thread of its own running an event loop, as a Ray async
actor runs: `actor.method.remote(...)` schedules the call there and returns a `LocalRef`, which
is awaitable and taken by `get` / `wait` as an `ObjectRef` is by `ray.get` / `ray.wait`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import threading
import types
from typing import Any, Callable

__all__ = ["LocalActor", "LocalRef", "get", "is_local", "kill", "put", "wait"]


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
        self._name = name or cls.__name__
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"molt-{self._name}")
        self._thread.start()
        try:    # built on its thread: what it sets per thread (torch's threads) stays its own
            self._instance = self._call(lambda: cls(*args, **kwargs)).result()
        except BaseException:
            self.kill()
            raise

    def _call(self, fn: Callable[[], Any]) -> cf.Future:
        future: cf.Future = cf.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                out = fn()
                if inspect.iscoroutine(out):
                    task = self._loop.create_task(out)
                    task.add_done_callback(lambda t: _settle(future, t))
                    future.add_done_callback(lambda f: f.cancelled() and
                                             self._loop.call_soon_threadsafe(task.cancel))
                    return
                future.set_result(out)
            except BaseException as e:
                future.set_exception(e)
        self._loop.call_soon_threadsafe(run)
        return future

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._instance, name)      # AttributeError: `hasattr` as on Ray handles
        return types.SimpleNamespace(remote=lambda *a, **kw: LocalRef(
            self._call(lambda: method(*a, **kw))))

    def __repr__(self) -> str:
        return f"LocalActor({self._name})"

    def kill(self) -> None:
        """Cancel what runs on the actor's loop, stop it and its thread."""
        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop)
            self._thread.join(timeout=30)


def _settle(future: cf.Future, task: asyncio.Task) -> None:
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


def is_local(handles: list) -> bool:
    return bool(handles) and all(isinstance(h, LocalActor) for h in handles)


def get(refs: Any, timeout: float | None = None) -> Any:
    """`ray.get` for Ray refs and `LocalRef`s (a list: one deadline for all)."""
    many = isinstance(refs, list)
    if not any(isinstance(r, LocalRef) for r in (refs if many else [refs])):
        import ray
        return ray.get(refs, timeout=timeout)
    done, pending = wait(refs if many else [refs], len(refs) if many else 1, timeout)
    if pending:
        raise TimeoutError(f"{len(pending)} local actor call(s) did not finish within {timeout}s")
    out = [r.future.result() for r in done]
    return out if many else out[0]


def wait(refs: list, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
    """`ray.wait`: (the first `num_returns` done, in `refs`' order; the rest)."""
    if not any(isinstance(r, LocalRef) for r in refs):
        import ray
        return ray.wait(refs, num_returns=num_returns, timeout=timeout)
    futures = {r.future: r for r in refs}
    pending = set(futures)
    deadline = None if timeout is None else _now() + timeout
    while len(futures) - len(pending) < num_returns and pending:
        left = None if deadline is None else max(0.0, deadline - _now())
        _, pending = cf.wait(pending, left, return_when=cf.FIRST_COMPLETED)
        if left == 0.0:
            break
    done = [r for r in refs if r.future not in pending][:num_returns]
    return done, [r for r in refs if r not in done]


def put(value: Any, handles: list) -> Any:
    """`ray.put` for Ray actors `handles`; for local ones the value itself (one address space)."""
    import ray
    return value if is_local(handles) else ray.put(value)


def kill(handle: Any) -> None:
    if isinstance(handle, LocalActor):
        handle.kill()
    else:
        import ray
        ray.kill(handle)


def _now() -> float:
    import time
    return time.monotonic()
