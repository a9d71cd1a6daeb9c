"""TRL `environment_factory` classes, unchanged, as chat agent `trl` (docs/adapters/trl.md)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import sys
from typing import Any

from molt_chat import ChatAgent, ChatContext
from molt_core import hookimpl
from molt_core.plugins import import_module
from molt_gym.envs import Dataset, _functions

__all__ = ["TRLEnvironment"]


def _arguments(raw: str) -> Any:        # as the model wrote them: JSON, or a string that is not
    with contextlib.suppress(ValueError):
        return json.loads(raw)
    return raw


async def _run(fn: Any, **kw: Any) -> Any:      # sync ones in a thread: never block generation
    return await (fn(**kw) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, **kw))


class TRLEnvironment(ChatAgent):
    """One `environment` (module:Class) instance per rollout; `data`: rows for `reset`."""

    def __init__(self, *, environment: str, data: str | None = None, data_args: dict | None = None,
                 reward: dict | None = None, max_tool_calling_iterations: int | None = None
                 ) -> None:
        from transformers.utils import get_json_schema     # here: `molt plugins` stays fast
        self.functions = _functions(tuple((reward or {}).items()))     # {module:function: weight}
        self.env = getattr(import_module(environment.rpartition(":")[0]),
                           environment.rpartition(":")[2])()
        members = dict(inspect.getmembers(type(self.env), inspect.isfunction))   # as TRL lists them
        if "reset" not in members:
            raise ValueError(f"agent_args.environment '{environment}' has no reset() method: TRL "
                             "calls it at the start of each rollout")
        self.tools = {n: getattr(self.env, n) for n in members
                      if n[0] != "_" and n not in ("reset", "get_reward")}
        self.schemas = [get_json_schema(f) for f in self.tools.values()]   # as TRL renders them
        if not (self.functions or "get_reward" in members):    # TRL: no reward source
            raise ValueError(f"agent_args.environment '{environment}' has no get_reward() method: "
                             "name reward functions in agent_args.reward")
        self.data = Dataset(data=data, reward=[], **data_args or {}) if data else None
        self.max_calls = sys.maxsize if max_tool_calling_iterations is None else \
            max_tool_calling_iterations

    async def run(self, ctx: ChatContext) -> float:
        import openai
        if self.data:
            await self.data.reset(ctx.task)         # the task's row; epochs by the run's seed
        row = dict(self.data.row if self.data else {"prompt": [{"role": "user", "content": ""}]})
        p = row["prompt"]
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else [dict(m) for m in p]
        messages[-1]["content"] += await _run(self.env.reset, **row) or ""
        start, kw = len(messages), {"tools": self.schemas} if self.schemas else {}
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                      timeout=600) as client:
            for turn in range(self.max_calls + 1):
                try:
                    msg = (await client.chat.completions.create(
                        model=ctx.model, messages=messages, **kw)).choices[0].message
                except openai.BadRequestError as e:     # TRL: tool results past the context
                    if e.code != "context_length_exceeded" or messages[-1]["role"] != "tool":
                        raise
                    while messages[-1]["role"] == "tool":   # are dropped; the rollout is scored
                        messages.pop()
                    break
                # TRL's form (parse_response): arguments as objects, no ids; reward functions get it
                calls = [{"type": "function", "function": {"name": c.function.name, "arguments":
                          _arguments(c.function.arguments)}} for c in msg.tool_calls or []]
                messages.append({"role": "assistant", "content": msg.content or "",
                                 **({"tool_calls": calls} if calls else {})})
                for c in calls if turn < self.max_calls else []:
                    messages.append({"role": "tool", "name": c["function"]["name"],
                                     "content": await self.call(**c["function"])})
                if messages[-1]["role"] != "tool":
                    break
        values = [await _run(self.env.get_reward)] if hasattr(self.env, "get_reward") else []
        for _, fn, weight in self.functions:        # as GRPOTrainer calls its reward_funcs
            values += [weight * v for v in await _run(
                fn, completions=[messages[start:]], prompts=[messages[:start]],
                environments=[self.env], **{k: [v] for k, v in row.items() if k != "prompt"})
                if v is not None]
        return float(sum(values)) if values else float("nan")

    async def call(self, name: str, arguments: Any) -> str:    # the result as text, errors as TRL's
        try:
            if name not in self.tools:
                raise ValueError(f"Tool {name} not found.")
            return str(await _run(self.tools[name], **arguments))
        except Exception as e:
            return str({"error": str(e)})


@hookimpl
def molt_chat_agents() -> dict:
    return {"trl": TRLEnvironment}
