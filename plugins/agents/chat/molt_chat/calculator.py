"""Example chat agent: answer "What is a + b?", where calling the calculator tool pays.

Turn 1: the policy either answers directly or calls `calculator` (Hermes `<tool_call>` JSON,
parsed by the server into an OpenAI `tool_calls` entry / Anthropic `tool_use` block). On a call,
the agent evaluates the expression, sends the result back as a tool message (masked), and the
policy answers in turn 2. Reward: 1 if the final answer's first number is a + b, else 0, given
per turn (`[answer]` for a direct answer, `[0, answer]` after a call).

`build_model` makes the CPU recipe's policy: a tiny random-init model taught both behaviours by a
short SFT (`imprint`): it calls the calculator (correctly) on a fifth of the questions and guesses
a random sum on the rest. A guess is right about one time in 15, the calculator nearly always: RL
has to learn *when to use the tool*, the decision researchers train agents for.
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

__all__ = ["Calculator", "TOOL", "build_model", "evaluate"]

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


def _expression(arguments: Any) -> str | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    expr = arguments.get("expression") if isinstance(arguments, dict) else None
    return expr if isinstance(expr, str) else None


class Calculator(ChatAgent):
    def __init__(self, *, api: str = "openai", lo: int = 2, hi: int = 9,
                 max_tokens: int | None = None) -> None:
        if api not in ("openai", "anthropic"):
            raise ValueError(f"api must be 'openai' or 'anthropic', got {api!r}")
        self.api, self.lo, self.hi, self.max_tokens = api, lo, hi, max_tokens

    def operands(self, task: int) -> tuple[int, int]:
        rng = random.Random(task)
        return rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)

    def question(self, task: int) -> tuple[str, int]:
        a, b = self.operands(task)
        return f"What is {a} + {b}?", a + b

    async def run(self, ctx: ChatContext) -> list[float]:
        question, answer = self.question(ctx.task)
        ctx.info["question"] = question
        call = self._openai if self.api == "openai" else self._anthropic
        rewards, text = await call(ctx, question)
        ctx.info["answer"] = text
        return rewards[:-1] + [float(_first_int(text) == answer)]

    def _result(self, arguments: Any) -> str:
        value = evaluate(_expression(arguments) or "")
        return "error" if value is None else str(value)

    async def _openai(self, ctx: ChatContext, question: str) -> tuple[list[float], str]:
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
                return [0.0], msg.content or ""
            tc = msg.tool_calls[0]
            messages += [msg.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": tc.id,
                          "content": self._result(tc.function.arguments)}]
            r = await client.chat.completions.create(messages=messages, **kw)
            return [0.0, 0.0], r.choices[0].message.content or ""

    async def _anthropic(self, ctx: ChatContext, question: str) -> tuple[list[float], str]:
        import anthropic
        client = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key,
                                          max_retries=0)
        tool = {"name": "calculator", "description": TOOL["function"]["description"],
                "input_schema": TOOL["function"]["parameters"]}
        kw: dict[str, Any] = {"model": ctx.model, "tools": [tool],
                              "max_tokens": self.max_tokens or 1024}

        def text(r: Any) -> str:
            return "".join(b.text for b in r.content if b.type == "text")

        async with client:
            messages: list[Any] = [{"role": "user", "content": question}]
            r = await client.messages.create(messages=messages, **kw)
            uses = [b for b in r.content if b.type == "tool_use"]
            if not uses:
                return [0.0], text(r)
            messages += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": uses[0].id,
                              "content": self._result(uses[0].input)}]}]
            r = await client.messages.create(messages=messages, **kw)
            return [0.0, 0.0], text(r)


def short_tools_template(template: str) -> str:
    """`template` with the long Qwen tools preamble replaced by `Tools: name ...` (same Hermes
    `<tool_call>` format): a tiny model's prompt shrinks from ~170 to ~20 tokens."""
    head, rest = template.split("{%- if tools %}", 1)
    _, tail = rest.split("{%- elif messages[0].role == 'system' %}", 1)
    short = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}
{{- 'Tools:' }}{%- for tool in tools %}{{- ' ' + (tool.function or tool).name }}{%- endfor %}
{{- '<|im_end|>\\n' }}
"""
    return head + short + "{%- elif messages[0].role == 'system' %}" + tail


def imprint_pairs(tok: Any, lo: int, hi: int, tool_rate: float,
                  seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, reply) pairs: for every question, one correct calculator transcript (call, then
    the answer) per `1 / tool_rate - 1` direct answers that guess a random sum."""
    rng = random.Random(seed)
    call = '<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call><|im_end|>'
    pairs = []
    for a in range(lo, hi + 1):
        for b in range(lo, hi + 1):
            msgs: list[dict] = [{"role": "user", "content": f"What is {a} + {b}?"}]
            prompt = tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                             add_generation_prompt=True)
            for _ in range(round(1 / tool_rate) - 1):
                pairs.append((prompt, f"The answer is {rng.randint(2 * lo, 2 * hi)}.<|im_end|>"))
            args = json.dumps({"expression": f"{a} + {b}"})
            pairs.append((prompt, call.format(args=args)))
            msgs += [{"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c", "type": "function",
                          "function": {"name": "calculator", "arguments": args}}]},
                     {"role": "tool", "tool_call_id": "c", "content": str(a + b)}]
            pairs.append((tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                                  add_generation_prompt=True),
                          f"The answer is {a + b}.<|im_end|>"))
    return pairs


def build_model(out_dir: str | Path, *, lo: int = 2, hi: int = 9, tool_rate: float = 0.2,
                steps: int = 400, batch_size: int = 32, lr: float = 1e-2,
                seed: int = 0) -> Path:
    """The recipe's policy in `out_dir`: a tiny random-init Qwen3 (short tools template) imprinted
    to call the calculator on a `tool_rate` share of the questions and to guess otherwise."""
    from transformers import AutoTokenizer

    from molt_chat.imprint import imprint
    from molt_tools.tiny import CHAT_TEMPLATE, build_tiny_model

    out = Path(out_dir)
    base = build_tiny_model(out / "base", vocab_size=1024, seed=seed,
                            extra_corpus=[
        "<|im_start|>system\nTools: calculator<|im_end|>\n",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
    ] * 50)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = short_tools_template(CHAT_TEMPLATE)
    tok.save_pretrained(base)
    imprint(base, out, imprint_pairs(tok, lo, hi, tool_rate, seed), steps=steps, lr=lr, tol=None,
            batch_size=batch_size, clip=1.0, decay=True, seed=seed)
    return out


if __name__ == "__main__":
    import sys
    print(build_model(sys.argv[1]))
