"""Example chat agent: answer "What is a + b?" by calling a calculator tool, through a stock SDK.

Turn 1: the policy should call `calculator` (Hermes `<tool_call>` JSON, parsed by the server into
an OpenAI `tool_calls` entry / Anthropic `tool_use` block). The agent evaluates the expression
and sends the result back as a tool message (masked). Turn 2: the policy should answer.

Shaped per-turn rewards (sum in [0, 1]):
  turn 1: 0.1 for emitting a `<tool_call>` block at all, 0.4 if it parses as a `calculator` call,
          +0.2 if the expression evaluates to a + b;
  turn 2: 0.3 if the answer's first number is a + b.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from pathlib import Path
from typing import Any

from molt_chat import ChatAgent, ChatContext

__all__ = ["Calculator", "TOOL", "evaluate"]

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int | None:
    """Integer + - * only; None for anything else (never raises on model output)."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError
    try:
        return ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


def _first_int(text: str | None) -> int | None:
    m = re.search(r"-?\d+", text or "")
    return int(m.group()) if m else None


class Calculator(ChatAgent):
    def __init__(self, *, api: str = "openai", lo: int = 1, hi: int = 4,
                 max_tokens: int | None = None) -> None:
        if api not in ("openai", "anthropic"):
            raise ValueError(f"api must be 'openai' or 'anthropic', got {api!r}")
        self.api, self.lo, self.hi, self.max_tokens = api, lo, hi, max_tokens

    def question(self, task: int) -> tuple[str, int]:
        rng = random.Random(task)
        a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
        return f"What is {a} + {b}? Use the calculator.", a + b

    async def run(self, ctx: ChatContext) -> list[float]:
        question, answer = self.question(ctx.task)
        ctx.info["question"] = question
        call = self._openai if self.api == "openai" else self._anthropic
        return await call(ctx, question, answer)

    def _score_call(self, name: str, arguments: Any, answer: int) -> tuple[float, int | None]:
        if name != "calculator":
            return 0.1, None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return 0.1, None
        expr = arguments.get("expression") if isinstance(arguments, dict) else None
        value = evaluate(expr) if isinstance(expr, str) else None
        self.expression = expr
        return 0.5 + 0.2 * (value == answer), value

    async def _openai(self, ctx: ChatContext, question: str, answer: int) -> list[float]:
        import openai
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        kw: dict[str, Any] = {"model": ctx.model, "tools": [TOOL]}
        if self.max_tokens:
            kw["max_tokens"] = self.max_tokens
        async with client:
            messages: list[Any] = [{"role": "user", "content": question}]
            r = await client.chat.completions.create(messages=messages, **kw)
            msg = r.choices[0].message
            if not msg.tool_calls:
                return [0.1 if "<tool_call>" in (msg.content or "") else 0.0]
            tc = msg.tool_calls[0]
            r1, value = self._score_call(tc.function.name, tc.function.arguments, answer)
            messages += [msg.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": tc.id,
                          "content": "error" if value is None else str(value)}]
            r = await client.chat.completions.create(messages=messages, **kw)
            ctx.info["answer"] = r.choices[0].message.content
            return [r1, 0.3 * (_first_int(r.choices[0].message.content) == answer)]

    async def _anthropic(self, ctx: ChatContext, question: str, answer: int) -> list[float]:
        import anthropic
        client = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key,
                                          max_retries=0)
        tool = {"name": "calculator", "description": TOOL["function"]["description"],
                "input_schema": TOOL["function"]["parameters"]}
        kw: dict[str, Any] = {"model": ctx.model, "tools": [tool],
                              "max_tokens": self.max_tokens or 1024}
        async with client:
            messages: list[Any] = [{"role": "user", "content": question}]
            r = await client.messages.create(messages=messages, **kw)
            uses = [b for b in r.content if b.type == "tool_use"]
            if not uses:
                text = "".join(b.text for b in r.content if b.type == "text")
                return [0.1 if "<tool_call>" in text else 0.0]
            r1, value = self._score_call(uses[0].name, uses[0].input, answer)
            messages += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": uses[0].id,
                              "content": "error" if value is None else str(value)}]}]
            r = await client.messages.create(messages=messages, **kw)
            text = "".join(b.text for b in r.content if b.type == "text")
            ctx.info["answer"] = text
            return [r1, 0.3 * (_first_int(text) == answer)]


def build_model(out_dir: str | Path, *, lo: int = 1, hi: int = 4, examples: int = 48,
                steps: int = 150, seed: int = 0) -> Path:
    """A tiny random-init model with a *format prior* for the calculator task, in `out_dir`.

    The tokenizer is trained with the tool-prompt boilerplate in its corpus (so the prompt is
    short), then the model is imprinted on transcripts whose *content is random*: the call's
    expression uses numbers unrelated to the question and the final answer is a random number.
    So the model knows the syntax (a `<tool_call>` with JSON, then "The answer is N.") but not
    which numbers to use; RL has to learn that from the reward.
    """
    from molt_core.tiny import build_tiny_model
    from molt_chat.imprint import imprint
    from transformers import AutoTokenizer

    out = Path(out_dir)
    probe = AutoTokenizer.from_pretrained(build_tiny_model(out / "probe", seed=seed))
    boiler = probe.apply_chat_template([{"role": "user", "content": "hi"}], tools=[TOOL],
                                       tokenize=False)
    base = build_tiny_model(out / "base", vocab_size=1024, seed=seed,
                            extra_corpus=[boiler] * 50 + ['{"expression": "3 + 4"}'] * 50)
    tok = AutoTokenizer.from_pretrained(base)
    rng = random.Random(seed)
    agent = Calculator(lo=lo, hi=hi)
    pairs = []
    for i in range(examples):
        question, _ = agent.question(rng.randrange(1 << 30))
        x, y = rng.randint(lo, hi), rng.randint(lo, hi)
        args = json.dumps({"expression": f"{x} + {y}"})
        msgs = [{"role": "user", "content": question}]
        call = f'<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call><|im_end|>'
        pairs.append((tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                              add_generation_prompt=True), call))
        msgs += [{"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c", "type": "function",
                      "function": {"name": "calculator", "arguments": args}}]},
                 {"role": "tool", "tool_call_id": "c", "content": str(x + y)}]
        pairs.append((tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                              add_generation_prompt=True),
                      f"The answer is {rng.randint(2 * lo, 2 * hi)}.<|im_end|>"))
    imprint(base, out, pairs, steps=steps, lr=3e-3, tol=None, batch_size=8, seed=seed)
    return out


if __name__ == "__main__":
    import sys
    print(build_model(sys.argv[1]))
