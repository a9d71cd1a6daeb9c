"""Fixtures for the chat plugin: the tiny model, and one imprinted to solve the calculator task."""

from __future__ import annotations

from pathlib import Path

import pytest

from molt_tools.tiny import build_tiny_model


@pytest.fixture(scope="session")
def chat_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("chat-tiny") / "qwen3", "qwen3")


@pytest.fixture(scope="session")
def solver_dir(chat_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Imprinted (in-test SFT) to call the calculator correctly and answer, for task 0."""
    from transformers import AutoTokenizer

    from molt_examples.calculator import TOOL, Calculator
    from molt_tools.imprint import imprint

    tok = AutoTokenizer.from_pretrained(chat_tiny_dir)
    pairs = []
    for task in range(1):
        question, answer = Calculator().question(task)
        a, b = question.split("What is ")[1].split("?")[0].split(" + ")
        args = f'{{"expression": "{a} + {b}"}}'
        msgs = [{"role": "user", "content": question}]
        pairs.append((tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                              add_generation_prompt=True),
                      f'<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n'
                      "</tool_call><|im_end|>"))
        msgs += [{"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c", "type": "function",
                      "function": {"name": "calculator", "arguments": args}}]},
                 {"role": "tool", "tool_call_id": "c", "content": str(answer)}]
        pairs.append((tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                              add_generation_prompt=True),
                      f"The answer is {answer}.<|im_end|>"))
    return imprint(chat_tiny_dir, tmp_path_factory.mktemp("solver"), pairs, tol=0.005)
