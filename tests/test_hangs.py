"""Hangs and slow rejections (issue 41 item 12): clients stalled inside a request's line or
headers are timed out; a failure-rate stop is one clear error."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

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
