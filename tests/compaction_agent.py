"""Test plugin: chat agent `recall`, whose answer depends on a fact stated before a compaction.

Turn 1: the user states a fact (`length` letters of `letters`); the policy replies (one token).
The history is then over budget: the policy summarises it (`Compactor`, the summary call), and
the conversation goes on from [summary, "q"] alone, so the answer can hold the fact only if the
summary does. Reward: the share of the answer's letters that match the fact, position by
position. Prompts are one-letter words so a tiny character model's rollouts stay short."""

from __future__ import annotations

import random

import openai

from molt_chat import ChatAgent, ChatContext, Compactor
from molt_core import hookimpl


class Recall(ChatAgent):
    def __init__(self, *, letters: str = "ab", length: int = 2) -> None:
        self.letters, self.length = letters, length

    async def run(self, ctx: ChatContext) -> float:
        fact = "".join(random.Random(ctx.task).choice(self.letters) for _ in range(self.length))
        compactor = Compactor(max_messages=2, keep=1, instruction="s", prefix="",
                              summary_tokens=self.length)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                    timeout=120)
        async with client:
            messages = [{"role": "user", "content": fact}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                     max_tokens=1)
            messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": "q"}]
            messages = await compactor(client, ctx.model, messages, r.usage)
            r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                     max_tokens=self.length)
        answer = r.choices[0].message.content or ""
        ctx.info.update(fact=fact, summary=messages[0]["content"], answer=answer)
        return sum(a == b for a, b in zip(answer, fact)) / self.length


@hookimpl
def molt_chat_agents() -> dict:
    return {"recall": Recall}
