"""A tool-using agent on the stock OpenAI SDK: "What is 347 * 28?" with a calculator tool.

SmolLM2-135M-Instruct cannot multiply a 3-digit by a 2-digit number in its head; with the tool it
only has to call it and copy the result. Every episode takes at least two model turns when the tool
is used (the call; the answer after the tool's result). Reward 1 if the final reply's last number
is the product. Problems are split by a hash of the operands: `split: test` (a fifth of them) is
never trained on. `CalculatorAgent.policy` is a scripted oracle (the cold start's demonstrations:
recipes/cpu/smollm2_agent_sft.yaml). The recipes: recipes/cpu/smollm2_agent_sft.yaml, then
recipes/cpu/smollm2_agent.yaml; `--plugin ./examples/calculator_agent.py`.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from typing import Any

import openai

from molt_chat import ChatAgent, ChatContext, ChatRunner
from molt_core import hookimpl

__all__ = ["CalculatorAgent", "HeldOutChat", "TOOLS", "calculate"]

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 12 * 34",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
_EXPR = re.compile(r"^\s*(-?\d{1,9})\s*([-+*x×])\s*(-?\d{1,9})\s*$")


def calculate(arguments: str) -> str:
    """The tool: `a op b` for + - * (x and × read as *); "error" for anything else."""
    try:
        expr = json.loads(arguments).get("expression")
    except (json.JSONDecodeError, AttributeError):
        return "error"
    m = _EXPR.match(expr) if isinstance(expr, str) else None
    if not m:
        return "error"
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def _last_int(text: str | None) -> int | None:
    nums = re.findall(r"-?\d+", (text or "").replace(",", ""))
    return int(nums[-1]) if nums else None


class CalculatorAgent(ChatAgent):
    def __init__(self, *, split: str = "train", max_turns: int = 3, system: str = "",
                 shots: int = 0) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split '{split}': use train or test")
        self.split, self.max_turns, self.system, self.shots = split, max_turns, system, shots
        self.held_out = split == "test"

    def problem(self, task: int) -> tuple[int, int]:
        rng = random.Random(task)
        while True:       # a fifth of the (a, b) pairs are test problems, the rest training's
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            if (zlib.crc32(f"{a}*{b}".encode()) % 5 == 0) == (self.split == "test"):
                return a, b

    async def run(self, ctx: ChatContext) -> float:
        a, b = self.problem(ctx.task)
        messages: list[Any] = [{"role": "system", "content": self.system}] if self.system else []
        for k in range(self.shots):     # worked examples: call, result, answer
            x, y = 111 + 37 * k, 12 + 5 * k
            messages += [{"role": "user", "content": f"What is {x} * {y}?"},
                         {"role": "assistant", "content": "", "tool_calls": [{
                             "id": f"ex{k}", "type": "function", "function": {
                                 "name": "calculator",
                                 "arguments": json.dumps({"expression": f"{x} * {y}"})}}]},
                         {"role": "tool", "tool_call_id": f"ex{k}", "content": str(x * y)},
                         {"role": "assistant", "content": f"{x} * {y} = {x * y}"}]
        messages.append({"role": "user", "content": f"What is {a} * {b}?"})
        calls = correct = 0
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                      max_retries=0, timeout=900) as client:
            for _ in range(self.max_turns):
                r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                         tools=TOOLS)
                msg = r.choices[0].message
                if not msg.tool_calls:
                    break
                messages.append(msg.model_dump(exclude_none=True))
                for tc in msg.tool_calls:          # every call answered, as the API requires
                    result = calculate(tc.function.arguments)
                    calls, correct = calls + 1, correct + (result == str(a * b))
                    messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
        answer = msg.content or ""
        solved = not msg.tool_calls and _last_int(answer) == a * b
        ctx.info.update(question=f"{a} * {b}", answer=answer, tool_calls=calls,
                        tool_correct=float(correct > 0), solved=float(solved),
                        format_ok=float(r.choices[0].finish_reason == "stop"))
        return float(solved)

    async def policy(self, messages: list[dict], tools: list[dict] | None) -> dict:
        """The oracle (`molt rollout --policy scripted`, the cold start's demonstrations): call
        the calculator on the question's product, then answer with the tool's result."""
        question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        a, b = map(int, re.findall(r"\d+", question)[-2:])
        if messages[-1]["role"] == "tool":
            return {"role": "assistant", "content": f"{a} * {b} = {messages[-1]['content']}"}
        return {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_0", "type": "function", "function": {
                "name": "calculator", "arguments": json.dumps({"expression": f"{a} * {b}"})}}]}


class HeldOutChat(ChatRunner):
    """The `chat` runner, telling evaluation when its agent serves the held-out split."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held_out = getattr(self.agent_cls(**self.agent_args), "held_out", False)


@hookimpl
def molt_chat_agents() -> dict:
    return {"calculator_sdk": CalculatorAgent}


@hookimpl
def molt_agents() -> dict:
    return {"tool_chat": HeldOutChat}
