"""A tool task Molt does not ship, started cold: "How many centimetres are 3.7 inches?" answered by
calling a `convert(value, from_unit, to_unit)` function tool through the stock OpenAI SDK.

SmolLM2-135M-Instruct cannot convert 3.7 inches to 9.398 centimetres in its head, and the stock
model never calls the tool (held-out base rate 0): every reward is 0 and RL has nothing to learn
from. The cold start (docs/agents.md, "Cold start: from reward 0 to a learning run"):
`UnitAgent.policy` is a scripted oracle that calls the tool and answers with its result, so
`molt rollout --policy scripted --keep 'reward>=1' --sft-out demos.jsonl` writes demonstrations,
`molt sft` trains on them and `molt run` goes on with RL. Episodes take two model turns (the
call; the answer after the tool's result). Reward 1 if the final reply's last number is the
converted value to the tool's three decimals. Problems are split by a hash of the question:
`split: test` (a fifth of them) is never trained on.

Recipes: recipes/cpu/smollm2_units_sft.yaml, recipes/cpu/smollm2_units.yaml; bench/smollm2_units.py
runs the pipeline; `--plugin ./examples/unit_agent.py`.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from typing import Any

import openai

from molt_chat import ChatAgent, ChatContext
from molt_core import hookimpl

__all__ = ["TOOLS", "UnitAgent", "convert"]

TOOLS = [{"type": "function", "function": {
    "name": "convert", "description": "Convert a value from one unit to another",
    "parameters": {"type": "object", "properties": {
        "value": {"type": "number"}, "from_unit": {"type": "string"},
        "to_unit": {"type": "string"}}, "required": ["value", "from_unit", "to_unit"]}}}]

# unit -> (dimension, size in the dimension's base unit)
_UNITS = {"inches": ("length", 0.0254), "centimetres": ("length", 0.01),
          "feet": ("length", 0.3048), "metres": ("length", 1.0), "yards": ("length", 0.9144),
          "miles": ("length", 1609.344), "kilometres": ("length", 1000.0),
          "pounds": ("mass", 0.45359237), "kilograms": ("mass", 1.0),
          "ounces": ("mass", 0.028349523125), "grams": ("mass", 0.001),
          "gallons": ("volume", 3.785411784), "litres": ("volume", 1.0)}
_ALIASES = {"inch": "inches", "in": "inches", "centimetre": "centimetres", "centimeter":
            "centimetres", "centimeters": "centimetres", "cm": "centimetres", "foot": "feet",
            "ft": "feet", "metre": "metres", "meter": "metres", "meters": "metres", "m": "metres",
            "yard": "yards", "yd": "yards", "mile": "miles", "mi": "miles", "kilometre":
            "kilometres", "kilometer": "kilometres", "kilometers": "kilometres", "km":
            "kilometres", "pound": "pounds", "lb": "pounds", "lbs": "pounds", "kilogram":
            "kilograms", "kg": "kilograms", "ounce": "ounces", "oz": "ounces", "gram": "grams",
            "g": "grams", "gallon": "gallons", "gal": "gallons", "litre": "litres", "liter":
            "litres", "liters": "litres", "l": "litres"}
PAIRS = [("inches", "centimetres"), ("feet", "metres"), ("yards", "metres"),
         ("miles", "kilometres"), ("pounds", "kilograms"), ("ounces", "grams"),
         ("gallons", "litres")]
PAIRS += [(b, a) for a, b in PAIRS]
QUESTIONS = ["How many {to} are {value} {frm}?", "Convert {value} {frm} to {to}.",
             "What is {value} {frm} in {to}?"]


def _unit(name: Any) -> str | None:
    key = str(name).strip().lower()
    return key if key in _UNITS else _ALIASES.get(key)


def exact(value: float, frm: str, to: str) -> float:
    return value * _UNITS[frm][1] / _UNITS[to][1]


def convert(arguments: str) -> str:
    """The tool: "9.398 centimetres" (three decimals), or an error saying what was wrong."""
    try:
        args = json.loads(arguments)
        value, frm, to = float(args["value"]), _unit(args["from_unit"]), _unit(args["to_unit"])
    except (json.JSONDecodeError, TypeError, KeyError, ValueError):
        return "error: call convert with a number value, from_unit and to_unit"
    if frm is None or to is None:
        return f"error: unknown unit; known: {', '.join(_UNITS)}"
    if _UNITS[frm][0] != _UNITS[to][0]:
        return f"error: cannot convert {_UNITS[frm][0]} to {_UNITS[to][0]}"
    return f"{exact(value, frm, to):.3f} {to}"


def _last_number(text: str | None) -> float | None:
    nums = re.findall(r"-?\d+(?:\.\d+)?", (text or "").replace(",", ""))
    return float(nums[-1]) if nums else None


class UnitAgent(ChatAgent):
    def __init__(self, *, split: str = "train", max_turns: int = 3) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split '{split}': use train or test")
        self.split, self.max_turns = split, max_turns

    def problem(self, task: int) -> tuple[str, float, str, str]:
        """(question, value, from unit, to unit); a fifth of the questions are test problems."""
        rng = random.Random(task)
        while True:
            frm, to = rng.choice(PAIRS)
            value = round(rng.uniform(1.0, 99.9), 1)
            q = rng.choice(QUESTIONS).format(value=value, frm=frm, to=to)
            if (zlib.crc32(q.encode()) % 5 == 0) == (self.split == "test"):
                return q, value, frm, to

    async def run(self, ctx: ChatContext) -> float:
        question, value, frm, to = self.problem(ctx.task)
        truth = exact(value, frm, to)
        messages: list[Any] = [{"role": "user", "content": question}]
        calls = correct = 0
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                      max_retries=0, timeout=3600) as client:
            for _ in range(self.max_turns):
                r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                         tools=TOOLS)
                msg = r.choices[0].message
                if not msg.tool_calls:
                    break
                messages.append(msg.model_dump(exclude_none=True))
                for tc in msg.tool_calls:          # every call answered, as the API requires
                    result = convert(tc.function.arguments)
                    calls, correct = calls + 1, correct + (result == f"{truth:.3f} {to}")
                    messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
        answer, got = msg.content or "", _last_number(msg.content)
        solved = not msg.tool_calls and got is not None and abs(got - truth) <= 6e-4
        ctx.info.update(question=question, answer=answer, tool_calls=calls,
                        tool_correct=float(correct > 0), solved=float(solved),
                        format_ok=float(r.choices[0].finish_reason == "stop"))
        return float(solved)

    async def policy(self, messages: list[dict], tools: list[dict] | None) -> dict:
        """The oracle: call convert on the question's value and units, then answer with the
        tool's result."""
        if messages[-1]["role"] == "tool":
            question = next(m["content"] for m in messages if m["role"] == "user")
            value, frm = re.search(r"(\d+\.\d) (\w+)", question).groups()
            return {"role": "assistant", "content": f"{value} {frm} is {messages[-1]['content']}."}
        question = messages[-1]["content"]
        value, frm = re.search(r"(\d+\.\d) (\w+)", question).groups()
        to = next(u for u in _UNITS if u != frm and re.search(rf"\b{u}\b", question))
        args = json.dumps({"value": float(value), "from_unit": frm, "to_unit": to})
        return {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_0", "type": "function",
            "function": {"name": "convert", "arguments": args}}]}


@hookimpl
def molt_chat_agents() -> dict:
    return {"units": UnitAgent}
