"""The calculator task with a stock OpenAI Agents SDK `Agent` (Responses API, a function tool).

Nothing Molt-specific beyond the client (`OpenAIResponsesModel` on `ctx.base_url`). A reply cut
at `max_new_tokens` is a Responses `incomplete` status, which the SDK raises on: the rollout then
scores 0 (its tokens are still trained on).
"""

from __future__ import annotations

from molt_chat import ChatContext
from molt_chat.calculator import TOOL, Calculator, _first_int

__all__ = ["AgentsCalculator"]


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
