"""The `chat` agent: real SDKs, real loopback server, real HFEngine (plain object, no Ray)."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest
from transformers import AutoTokenizer

from molt_chat import ChatAgent, ChatContext, ChatRunner
from molt_core.chat.server import shared_server
from molt_core.config import Config
from molt_core.engines.hf import HFEngine
from molt_core.contracts import RolloutContext
from molt_core.plugins import PluginError, build_plugins

COLD = {"temperature": 0.05, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
        "max_new_tokens": 40}


def runner_for(model_dir, **agent) -> ChatRunner:
    cfg = Config()
    cfg.model.path = str(model_dir)
    return ChatRunner(cfg, AutoTokenizer.from_pretrained(model_dir), build_plugins(), **agent)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_concurrent_calculator_rollouts(solver_dir, api):
    runner = runner_for(solver_dir, agent="calculator", agent_args={"api": api})
    tok = runner.tok

    async def main():
        engine = HFEngine(str(solver_dir))
        ctxs = [RolloutContext(0, i, 0, dict(COLD), engine.generate, tok) for i in range(8)]
        trajs = await asyncio.gather(*(runner.rollout(c) for c in ctxs))
        server = await shared_server()
        open_sessions = len(server.sessions)
        await server.close()
        return trajs, open_sessions, await engine.stats()

    trajs, open_sessions, stats = asyncio.run(main())
    assert open_sessions == 0
    assert stats["batches"] < 16, "concurrent sessions share engine waves"
    for t in trajs:
        t.check(len(tok))
        assert t.turn_rewards == [0.0, 1.0] and t.reward == 1.0
        assert t.segments == [0] and t.info["chat_generations"] == 2
        assert len(t.info["turn_spans"]) == 2 and all(t.loss_mask[a:b] == [True] * (b - a)
                                                      for a, b in t.info["turn_spans"])


class Crashes(ChatAgent):
    async def run(self, ctx: ChatContext) -> float:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model, messages=[
            {"role": "user", "content": "hi"}], max_tokens=2)
        raise KeyError("agent bug")


class Silent(ChatAgent):
    async def run(self, ctx: ChatContext) -> float:
        return 1.0


def test_agent_errors_propagate_and_close_the_session(chat_tiny_dir):
    runner = runner_for(chat_tiny_dir, agent="calculator")
    tok = runner.tok

    async def main():
        engine = HFEngine(str(chat_tiny_dir))
        ctx = RolloutContext(0, 0, 0, {**COLD, "temperature": 1.0}, engine.generate, tok)
        errors = []
        for cls in (Crashes, Silent):
            runner.agent_cls = cls
            try:
                await runner.rollout(ctx)
            except Exception as e:  # the generator drops the rollout (rollout/dropped/agent_error)
                errors.append(type(e).__name__)
        server = await shared_server()
        left = len(server.sessions)
        await server.close()
        return errors, left

    errors, left = asyncio.run(main())
    assert errors == ["KeyError", "RuntimeError"] and left == 0


def test_unknown_chat_agent_lists_valid(chat_tiny_dir):
    with pytest.raises(PluginError, match="unknown chat_agent 'nope'; valid: agents_calculator, calculator"):
        runner_for(chat_tiny_dir, agent="nope")


def test_generator_close_shuts_the_shared_server_down(chat_tiny_dir):
    from molt_core.rollout.generator import Generator

    gen = Generator(runner_for(chat_tiny_dir, agent="calculator"), [], Config(), None, 0)
    server = gen.submit(shared_server()).result(timeout=10)
    socket.create_connection((server.host, server.port), timeout=2).close()   # serving
    gen.close()
    with pytest.raises(OSError):
        socket.create_connection((server.host, server.port), timeout=2).close()
