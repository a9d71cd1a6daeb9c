"""Example chat agents of the chat calculator recipe (registered by `molt_examples` as
`calculator` and `agents_calculator`): answer "What is a + b?", where calling the calculator
tool pays.

Turn 1: the policy answers directly or calls `calculator`; on a call the agent sends the result
back as a tool message (masked) and the policy answers in turn 2. Reward: 1 if the final answer's
first number is a + b, else 0, per turn (`[answer]`, or `[0, answer]` after a call).

The CPU recipe's policy (`molt_tools.calculator_model.build_model`) is taught both behaviours by a
short SFT: it calls the calculator on a fifth of the questions and guesses the rest. A guess is
right about one time in 15, the calculator nearly always: RL has to learn *when to use the tool*.

`AgentsCalculator` is the same task on a stock OpenAI Agents SDK `Agent` (Responses API, a
function tool), nothing Molt-specific beyond the client (`OpenAIResponsesModel` on
`ctx.base_url`). A reply cut at `max_new_tokens` is a Responses `incomplete` status, which the SDK
raises on: the rollout then scores 0 (its tokens are still trained on).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

from molt_chat import ChatAgent, ChatContext

__all__ = ["AgentsCalculator", "Calculator", "TOOL", "evaluate"]

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

    async def policy(self, messages: list[dict], tools: list[dict] | None) -> dict:
        """The oracle: call the calculator on the question, then answer with its result."""
        if messages[-1]["role"] == "tool":
            return {"role": "assistant", "content": messages[-1]["content"]}
        expr = re.sub(r"^What is (.*)\?$", r"\1", messages[-1]["content"])
        return {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_0", "type": "function", "function": {
                "name": "calculator", "arguments": json.dumps({"expression": expr})}}]}

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


class AgentsCalculator(Calculator):
    async def run(self, ctx: ChatContext) -> float:   # type: ignore[override]
        import openai
        from agents import (Agent, FunctionTool, MaxTurnsExceeded, ModelBehaviorError,
                            OpenAIResponsesModel, Runner, set_tracing_disabled)

        set_tracing_disabled(True)       # the SDK would export traces to OpenAI's servers
        question, answer = self.question(ctx.task)
        ctx.info["question"] = question

        async def calculator(_: object, arguments: str) -> str:
            return self._result(arguments)

        fn = TOOL["function"]
        tool = FunctionTool(name=fn["name"], description=fn["description"],
                            params_json_schema=fn["parameters"], on_invoke_tool=calculator,
                            strict_json_schema=False)
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                      max_retries=0) as client:
            agent = Agent(name="calculator", model=OpenAIResponsesModel(ctx.model, client),
                          tools=[tool])
            try:
                result = await Runner.run(agent, question, max_turns=3)
            except (ModelBehaviorError, MaxTurnsExceeded) as e:
                ctx.info["agent_stopped"] = type(e).__name__
                return 0.0
        ctx.info["answer"] = result.final_output
        return float(_first_int(str(result.final_output)) == answer)
