"""Hangs and slow rejections (issue 41 item 12): clients stalled inside a request's line or
headers are timed out; a failure-rate stop is one clear error; an error exit never waits for a
reward blocked forever; a checkpoint does not wait on a hung engine past a signal or its
engine.timeout_s."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from molt_core.chat.server import ChatServer

from common import toy_recipe


def test_clients_stalled_in_the_request_line_or_headers_are_closed():
    """100 clients stop inside the request line, 100 inside the headers, 100 inside the second
    request's headers on a kept-alive connection: the server closes each once its head timeout
    (body_timeout_s) is up, as it answers a body stall with a 408. (Before: held forever.)"""
    async def stall(server: ChatServer, head: bytes, first: bytes = b"") -> bytes:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            if first:               # a whole request (a 404), then the stall on the same socket
                writer.write(first)
                got = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
                await reader.readexactly(int(got.split("content-length: ")[1].split("\r")[0]))
            writer.write(head)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 120)   # not a time assert: a hang guard
        finally:
            writer.close()

    async def main() -> list[bytes]:
        server = ChatServer(body_timeout_s=1.0)
        await server.start()
        whole = b"GET /nothing HTTP/1.1\r\nhost: x\r\n\r\n"
        heads = [b"POST /s/abc/v1/chat/compl"] * 100 + [
            b"POST /s/abc/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-ty"] * 100
        try:
            return await asyncio.gather(*(stall(server, h) for h in heads), *(
                stall(server, b"GET /again HTTP/1.1\r\nhos", whole) for _ in range(100)))
        finally:
            await server.close()

    answers = asyncio.run(main())
    assert all(a == b"" for a in answers), [a for a in answers if a][:1]


@pytest.mark.parametrize("rate", ["0.5", "1.0"])
def test_a_failure_rate_stop_is_one_clear_error(tiny_model_dir, tmp_path, rate):
    """A reward that always raises: past agent.max_failure_rate (0.5), or never past it (1.0:
    no group completes), the run exits with one error line, not tracebacks nor asyncio's 'Task
    exception was never retrieved' (2-12 of them before)."""
    rows = [json.dumps({"prompt": f"say {i}", "answer": str(i)}) for i in range(20)]
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "bad_reward.py").write_text("def reward(completion, **kw):\n"
                                            "    raise ValueError('boom')\n")
    recipe = toy_recipe(tmp_path, tiny_model_dir, out_dir=str(tmp_path / "runs"), agent={
        "max_failure_rate": float(rate), "args": {"env": "dataset", "env_args": {
            "data": str(tmp_path / "rows.jsonl"), "reward": "bad_reward:reward"}}})
    proc = subprocess.run([sys.executable, "-m", "molt_tools", "run", recipe, "trainer.steps=2",
                           "--no-progress"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    err = [ln for ln in proc.stderr.splitlines() if "] agent_error" not in ln]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert [ln for ln in err if ln.startswith("error: ")] == [err[-1]], err[-20:]
    assert "reward function 'bad_reward:reward' failed" in err[-1]
    assert "Traceback" not in proc.stderr and "never retrieved" not in proc.stderr, err[-40:]


JUDGE = """import threading
_first = threading.Lock()


def judge(*args, **kwargs):
    \"\"\"The first call never answers (a judge that hangs), every other one raises.\"\"\"
    if _first.acquire(blocking=False):
        threading.Event().wait()
    raise ValueError('boom')
"""
STUCK_CHAT = """import asyncio

import httpx
import openai

from molt_chat import ChatAgent
from molt_core import hookimpl
from judge import judge


class Stuck(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                    timeout=120, http_client=httpx.AsyncClient(verify=False))
        async with client:
            await client.chat.completions.create(model=ctx.model, max_tokens=2, messages=[
                {"role": "user", "content": "hi"}])
        return await asyncio.to_thread(judge)


@hookimpl
def molt_chat_agents():
    return {"stuck": Stuck}
"""


@pytest.mark.parametrize("agent", ["gym", "chat"])
def test_an_error_exit_does_not_wait_for_a_reward_blocked_forever(tiny_model_dir, tmp_path, agent):
    """A reward whose first call never returns (its rollout times out, agent.timeout_s) and
    whose other calls raise, agent.max_failure_rate 1.0: the run stops with its one error line
    and the process exits. (Before: it printed the error, then hung in interpreter shutdown,
    joining the blocked thread of the loop's default executor.)"""
    (tmp_path / "rows.jsonl").write_text("".join(
        json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(20)))
    (tmp_path / "judge.py").write_text(JUDGE)
    (tmp_path / "stuck_chat.py").write_text(STUCK_CHAT)
    args = {"agent": "stuck"} if agent == "chat" else {"env": "dataset", "env_args": {
        "data": str(tmp_path / "rows.jsonl"), "reward": "judge:judge"}}
    recipe = toy_recipe(tmp_path, tiny_model_dir, out_dir=str(tmp_path / "runs"), agent={
        "name": agent, "max_failure_rate": 1.0, "timeout_s": 5.0, "args": args})
    plugin = ["--plugin", "stuck_chat"] if agent == "chat" else []
    proc = subprocess.run([sys.executable, "-m", "molt_tools", "run", recipe, "trainer.steps=2",
                           "--no-progress", *plugin], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    err = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert err[-1].startswith("error: could not complete 4 groups") and "ValueError: boom" in \
        err[-1], err[-10:]


HANG_ENGINE = """import os, signal, sys
from pathlib import Path

from molt_core import hookimpl


def _pid(_actor):
    return os.getpid()


@hookimpl
def molt_state_dict():
    \"\"\"Inside the first checkpoint write: engine 0's process stops (as a hung engine: Ray
    does not call it dead), then the marker file says so.\"\"\"
    marker = Path(os.environ["MOLT_TEST_MARKER"])
    if not marker.exists():
        import ray
        from molt_core.run.cluster import engine_name
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        engine = ray.get_actor(engine_name(0))
        os.kill(ray.get(engine.__ray_call__.remote(_pid), timeout=60), signal.SIGSTOP)
        marker.write_text("stopped")
"""


@pytest.mark.parametrize("stop", ["sigint", "engine_timeout"])
def test_a_checkpoint_does_not_wait_on_a_hung_engine(tiny_chars_dir, tmp_path, stop):
    """Engine 0 hangs inside the first checkpoint write (SIGSTOP; ray.embedded off). SIGINT then
    stops the run at once, the checkpoint saved without that engine's RNG; without a signal, the
    checkpoint is saved once engine.timeout_s is up and the run stops with one error naming the
    engine. (Before: the save waited engine.timeout_s (3000 s here) for the engine's RNG with
    SIGINT only logged, then a GetTimeoutError traceback and no checkpoint.)"""
    (tmp_path / "hang_engine.py").write_text(HANG_ENGINE)
    marker, run_dir = tmp_path / "marker", tmp_path / "runs"
    recipe = toy_recipe(tmp_path, tiny_chars_dir, out_dir=str(run_dir))
    ray_tmp = tempfile.mkdtemp(prefix="rayh", dir="/tmp")     # unix socket paths are short
    proc = subprocess.Popen(
        [sys.executable, "-m", "molt_tools", "run", recipe, "trainer.steps=3",
         "trainer.save_every=1", "ray.embedded=off", "--no-progress", "--plugin", "hang_engine",
         "engine.timeout_s=" + ("3000" if stop == "sigint" else "60")],
        stderr=subprocess.PIPE, text=True, env={
            **os.environ, "PYTHONPATH": str(tmp_path), "MOLT_TEST_MARKER": str(marker),
            "RAY_TMPDIR": ray_tmp})
    try:
        if stop == "sigint":
            while not marker.exists() and proc.poll() is None:
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=600)[1]     # a hang guard, not a time assert
    finally:
        proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = err.splitlines()
    assert "engine does not answer: the checkpoint has not its RNG" in err, err[-3000:]
    assert (run_dir / os.listdir(run_dir)[0] / "checkpoints/step_000001/driver.pt").is_file()
    assert "Traceback" not in err, err[-3000:]
    if stop == "sigint":
        assert proc.returncode == 0 and "stopped" in err and "step_000001" in err, err[-3000:]
    else:
        assert proc.returncode == 2, err[-3000:]
        assert lines[-1].startswith("error: engine 0 (Actor(HFEngine") and \
            "did not answer within 60.0s (engine.timeout_s) while" in lines[-1], lines[-5:]
        assert "(from step_000001)" in lines[-1]


def test_a_prompt_row_too_long_for_the_model_is_refused_before_tokenizing(tiny_model_dir,
                                                                          tmp_path, monkeypatch):
    """A dataset row whose prompt has more characters than the model's positions can hold at any
    tokenization (max_position_embeddings x the longest vocabulary entry) fails its rollout by
    its length, untokenized (a 20 MB row took 6 minutes and 8.8 GB to reach the engine's
    refusal); a row that fits reaches the engine."""
    from transformers import AutoConfig, AutoTokenizer

    from molt_core.cli import load
    from molt_core.contracts import RolloutContext

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    bound = AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings * max(
        map(len, tok.get_vocab()))
    rows = [{"prompt": "a" * (bound + 1), "answer": "1"}, {"prompt": "say 1", "answer": "1"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "one_reward.py").write_text("def reward(completion, **kw):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, plugins = load(toy_recipe(tmp_path, tiny_model_dir, agent={"args": {
        "env": "dataset", "chat_template": False, "env_args": {
            "data": str(tmp_path / "rows.jsonl"), "reward": "one_reward:reward",
            "test_fraction": 0.0, "shuffle": False}}}), [])
    agent = plugins.get("agent", "gym")(cfg, tok, plugins, **cfg.agent.args)
    reached = []

    async def generate(ids, sampling, images=None):
        reached.append(len(ids))
        raise RuntimeError("reached the engine")

    def rollout(task: int):
        return asyncio.run(agent.rollout(RolloutContext(0, 0, task, {}, generate, tok)))

    with pytest.raises(ValueError, match=rf"the prompt has {bound + 1} characters: more than "
                                         rf"the model's positions can hold .*\({bound}\)"):
        rollout(0)
    assert reached == []
    with pytest.raises(RuntimeError, match="reached the engine"):
        rollout(1)
    assert len(reached) == 1


def test_closing_the_chat_server_with_a_request_in_flight_is_quiet(tiny_model_dir):
    """A stop closes the server with a rollout's request still generating: it is cancelled after
    the grace, without uvicorn's 'timeout graceful shutdown exceeded' error and the request's
    CancelledError traceback (issue 41 item 10's stop logged both)."""
    import logging

    from transformers import AutoTokenizer

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append

    async def forever(ids, sampling, images=None):
        await asyncio.sleep(3600)

    async def main() -> None:
        server = ChatServer()
        await server.start()            # uvicorn's logging config is set: now the handler
        logging.getLogger("uvicorn.error").addHandler(handler)
        s = server.open_session(AutoTokenizer.from_pretrained(tiny_model_dir), forever,
                                {"max_new_tokens": 4, "temperature": 1.0}, max_context=512)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        _, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(f"POST {s.base_url.split(str(server.port), 1)[1]}/chat/completions HTTP/1.1"
                     f"\r\nhost: x\r\nauthorization: Bearer {s.api_key}\r\ncontent-type: "
                     f"application/json\r\ncontent-length: {len(body)}\r\n\r\n{body}".encode())
        await writer.drain()
        while not s.trajectory.token_ids:       # the prompt is in: the request is generating
            await asyncio.sleep(0.05)
        await server.close()
        writer.close()

    try:
        asyncio.run(main())
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert [r for r in records if r.levelno >= logging.ERROR] == [], [
        r.getMessage() for r in records]
