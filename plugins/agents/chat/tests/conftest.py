"""Fixtures for the chat plugin: the tiny model, and one taught (molt sft) to solve the calculator task."""

from __future__ import annotations

from pathlib import Path

import pytest

from molt_tools.tiny import build_tiny_model


@pytest.fixture(scope="session")
def chat_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("chat-tiny") / "qwen3", "qwen3")


@pytest.fixture(scope="session")
def solver_dir(chat_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Taught (molt sft on the calculator agent's scripted oracle, `Calculator.policy`, as
    `molt rollout --policy scripted` records it) to call the calculator and answer, for task 0."""
    import asyncio

    from molt_examples.calculator import TOOL, Calculator
    from molt_tools.calculator_model import sft_model

    agent = Calculator()
    msgs = [{"role": "user", "content": agent.question(0)[0]}]
    call = asyncio.run(agent.policy(msgs, [TOOL]))
    msgs += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"],
                    "content": agent._result(call["tool_calls"][0]["function"]["arguments"])}]
    msgs.append(asyncio.run(agent.policy(msgs, [TOOL])))
    return sft_model(chat_tiny_dir, tmp_path_factory.mktemp("solver"),
                     [{"messages": msgs, "tools": [TOOL]}], steps=60, tol=0.005)
