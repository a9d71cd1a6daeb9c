"""Adapter `mcp` (molt-adapter-mcp): a real FastMCP server over stdio (tests/mcp_add_server.py,
docs/adapters/mcp.md's) serves the tools; rollouts are token-exact and train a few steps.

The tiny random-init model never emits a tool call on its own, so it is imprinted (a few SFT
steps) to call `add` and then answer; the code under test is the adapter, the MCP SDK's client
and server, the loopback server and the trainer, unchanged."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import molt_core
from molt_chat import ChatRunner
from molt_core.chat.server import shared_server
from molt_core.config import Config
from molt_core.contracts import RolloutContext
from molt_core.engines.hf import HFEngine
from molt_core.plugins import build_plugins
from molt_tools.view import read_trajectories
from test_chat_server import Recorder, decode, runs

HERE = Path(__file__).parent
DOC = HERE.parent / "docs" / "adapters" / "mcp.md"
SERVER = [sys.executable, "add_server.py"]       # the doc's `python`, this venv's
ARGS = {"server": SERVER, "data": "data/sums.jsonl", "data_args": {"test_fraction": 0.0},
        "reward": {"rewards:correct": 1.0}, "timeout_s": 60.0}
SAMPLING = {"temperature": 0.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_new_tokens": 40}
TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
        "parameters": {"properties": {"a": {"title": "A", "type": "integer"},
                                      "b": {"title": "B", "type": "integer"}},
                       "required": ["a", "b"], "title": "addArguments", "type": "object"}}}


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """The doc's files, verbatim, in a directory of their own; its server is tests/'."""
    out = tmp_path_factory.mktemp("mcp_example")
    blocks = dict(re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', DOC.read_text(), re.S))
    assert set(blocks) == {"add_server.py", "data/sums.jsonl", "rewards.py", "sums.yaml"}
    assert blocks["add_server.py"] == (HERE / "mcp_add_server.py").read_text()
    for title, body in blocks.items():
        (out / title).parent.mkdir(parents=True, exist_ok=True)
        (out / title).write_text(body)
    return out


@pytest.fixture(scope="module")
def caller_dir(tiny_model_dir, example, tmp_path_factory) -> Path:
    """The tiny model (short tools template), imprinted to call `add`, then give the sum."""
    from molt_tools.calculator_model import short_tools_template
    from molt_tools.imprint import imprint

    base = tmp_path_factory.mktemp("mcp_base") / "model"
    shutil.copytree(tiny_model_dir, base)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = short_tools_template(tok.chat_template)
    tok.save_pretrained(base)
    pairs = []
    for row in map(json.loads, (example / "data/sums.jsonl").read_text().splitlines()):
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        msgs = [{"role": "user", "content": row["prompt"]}]
        args = json.dumps({"a": a, "b": b})
        pairs.append((tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                              add_generation_prompt=True),
                      f'<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'
                      "<|im_end|>"))
        msgs += [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type":
                  "function", "function": {"name": "add", "arguments": args}}]},
                 {"role": "tool", "tool_call_id": "c", "name": "add", "content": str(a + b)}]
        pairs.append((tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                              add_generation_prompt=True),
                      f"It is {a + b}.<|im_end|>"))
    return imprint(base, tmp_path_factory.mktemp("mcp_caller"), pairs, steps=400, tol=0.01)


def rollouts(model_dir: Path, agent_args: dict, n: int) -> tuple[list, Recorder]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = Config()
    cfg.model.path = str(model_dir)
    runner = ChatRunner(cfg, tok, build_plugins(), agent="mcp", agent_args=agent_args)

    async def main():
        rec = Recorder(HFEngine(str(model_dir), seed=3))
        try:
            return await asyncio.gather(*(runner.rollout(RolloutContext(g, 0, g, dict(SAMPLING),
                                                                        rec, tok))
                                          for g in range(n))), rec
        finally:
            await (await shared_server()).close()

    return asyncio.run(main())


def test_rollouts_are_token_exact_with_the_servers_results(caller_dir, example, monkeypatch):
    monkeypatch.chdir(example)
    monkeypatch.syspath_prepend(str(example))
    trajs, rec = rollouts(caller_dir, ARGS, 3)       # concurrent: one server, one session
    tok = AutoTokenizer.from_pretrained(caller_dir)
    completions = [c for _, c in rec.calls]
    for traj in trajs:
        traj.check(len(tok))
        parts = runs(traj)
        assert [p[0] for p in parts] == [False, True, False, True]    # prompt, call, result, end
        for _, ids, lps in (p for p in parts if p[0]):                 # trainable = sampled
            assert any((ids, lps) == (c.token_ids, c.logprobs) for c in completions)
        assert "Tools: add" in decode(tok, parts[0][1])                 # list_tools, offered
        a, b = map(int, re.findall(r'"[ab]": (-?\d+)', decode(tok, parts[1][1])))
        assert f"<tool_response>\n{a + b}\n</tool_response>" in decode(tok, parts[2][1])
        answer = decode(tok, parts[3][1])
        question = re.search(r"What is (\d+) \+ (\d+)\?", decode(tok, parts[0][1])).groups()
        assert traj.reward == float(str(sum(map(int, question))) in answer)
    assert sum(len(p[1]) for t in trajs for p in runs(t) if p[0]) == \
        sum(len(c.token_ids) for c in completions)


def test_trains_a_few_steps(ray_local, caller_dir, example, monkeypatch, tmp_path):
    monkeypatch.chdir(example)
    monkeypatch.syspath_prepend(str(example))
    run = molt_core.train("sums.yaml", {
        "model.path": str(caller_dir), "trainer.steps": 2, "out_dir": str(tmp_path),
        "rollout.group_size": 2, "agent.args.agent_args.server": SERVER,
        "check.consistency_every": 1, "log.trajectories_per_step": 4})
    assert len([r for r in run.history if "reward/mean" in r]) == 2
    rows = read_trajectories(run.run_dir)
    assert {r["step"] for r in rows} == {1, 2} and len(rows) == 8
    tok = AutoTokenizer.from_pretrained(caller_dir)
    results = 0
    for r in rows:
        masked = tok.decode([t for t, m in zip(r["token_ids"], r["loss_mask"]) if not m])
        results += "<tool_response>" in masked
        on = [abs(a - b) for a, b, m in zip(r["trainer_logprobs"], r["behavior_logprobs"],
                                            r["loss_mask"]) if m]
        assert on and max(on) < 1e-3                # the trainer scored what was sampled
    assert results >= 4, "the imprinted policy calls the MCP tool in most rollouts"


def test_a_server_that_cannot_start_is_one_clear_error(tiny_model_dir, example, monkeypatch):
    monkeypatch.chdir(example)
    monkeypatch.syspath_prepend(str(example))
    # a server that exits at once: "Connection closed", or a broken pipe if it is gone first
    for server, why in (([sys.executable, "missing_server.py"], ""),
                        (["no-such-mcp-server"], "FileNotFoundError"), ([], "IndexError")):
        with pytest.raises(RuntimeError, match=re.escape(f"MCP server {server} did not start: "
                                                         f"{why}")):
            rollouts(tiny_model_dir, {**ARGS, "server": server}, 1)
