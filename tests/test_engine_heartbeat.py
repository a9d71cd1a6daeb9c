"""An engine that answers late (a starved box) is said before `engine.timeout_s` ends the call:
each `HEARTBEAT_S` unanswered, a warning with the engine's requests in flight and the load."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from molt_core.rollout import client as client_mod
from molt_core.rollout.client import EngineClient
from molt_core.trajectory import Completion


@pytest.mark.timeout(120)      # without heartbeats the loop below would wait forever
def test_a_late_engine_is_said_each_heartbeat_then_answers(monkeypatch):
    monkeypatch.setattr(client_mod, "HEARTBEAT_S", 0.01)
    answer = None

    async def generate_batch(prompts, samplings, **kw):     # stand-in engine: answers when told
        await answer.wait()
        return [Completion([7], [-0.1], [0]) for _ in prompts]

    engine = SimpleNamespace(generate_batch=SimpleNamespace(remote=generate_batch))
    client = EngineClient([engine], timeout_s=300.0)

    async def main() -> tuple[list, list]:
        nonlocal answer
        answer = asyncio.Event()
        with capture_logs() as logs:
            calls = asyncio.gather(*(client.generate([i], {}) for i in range(3)))
            while sum(e["event"] == "engine_slow" for e in logs) < 2:    # two heartbeats, then
                await asyncio.sleep(0.005)                                # the engine answers
            answer.set()
            return await calls, logs

    outs, logs = asyncio.run(main())
    assert [o.token_ids for o in outs] == [[7]] * 3
    slow = [e for e in logs if e["event"] == "engine_slow"]
    assert slow[0]["log_level"] == "warning" and slow[0]["engine"] == 0
    assert slow[0]["requests"] == 3 and slow[0]["timeout_s"] == 300.0       # one batch of 3
    assert [e["unanswered_s"] for e in slow[:2]] == pytest.approx([0.01, 0.02])
    assert len(slow[0]["load"]) == 3 and slow[0]["cpus"] == os.cpu_count()


def test_no_answer_within_the_timeout_fails_the_requests(monkeypatch):
    """The heartbeats stop at `engine.timeout_s`: the call is given up (and aborted there)."""
    monkeypatch.setattr(client_mod, "HEARTBEAT_S", 0.01)
    aborted = []

    async def generate_batch(prompts, samplings, **kw):
        await asyncio.Event().wait()                        # never answers

    async def abort(ids):
        aborted.extend(ids)

    engine = SimpleNamespace(generate_batch=SimpleNamespace(remote=generate_batch),
                             abort=SimpleNamespace(remote=abort))
    client = EngineClient([engine], timeout_s=0.035)

    async def main() -> list:
        with capture_logs() as logs, pytest.raises(TimeoutError, match="within 0.035s"):
            await client.generate([1], {})
        await asyncio.gather(*client.aborts)
        return logs

    logs = asyncio.run(main())
    assert [e["unanswered_s"] for e in logs if e["event"] == "engine_slow"] == pytest.approx(
        [0.01, 0.02, 0.03])
    assert len(aborted) == 1
