"""Test plugin: chat agent `recall`, whose answer depends on a fact stated before a compaction.

Turn 1: the user states a fact (`length` letters of `letters`) and the policy echoes it. The
history is then over budget: the policy summarises it (`Compactor`, the summary call, prompt
[fact, echo, "s"]), and the conversation goes on from [summary] alone, so the answer (an echo of
its one user message) holds the fact only if the summary does. Reward: the share of the answer's
letters that match the fact, position by position (`info["recall"]`)."""

from __future__ import annotations

import itertools
import random

import httpx
import openai

from molt_chat import ChatAgent, ChatContext, Compactor
from molt_core import hookimpl


class Recall(ChatAgent):
    def __init__(self, *, letters: str = "ab", length: int = 2) -> None:
        self.letters, self.length = letters, length

    async def run(self, ctx: ChatContext) -> float:
        fact = "".join(random.Random(ctx.task).choice(self.letters) for _ in range(self.length))
        compactor = Compactor(max_messages=1, keep=0, instruction="s", prefix="",
                              summary_tokens=self.length)
        # plain http on loopback: verify=False skips loading the CA bundle (~50-250 ms CPU a client)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                    timeout=120, http_client=httpx.AsyncClient(verify=False))
        async with client:
            messages = [{"role": "user", "content": fact}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                     max_tokens=self.length)
            echo = r.choices[0].message.content or ""
            messages = await compactor(client, ctx.model, [
                *messages, {"role": "assistant", "content": echo}], r.usage)
            r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                     max_tokens=self.length)
        answer = r.choices[0].message.content or ""
        recall = sum(a == b for a, b in zip(answer, fact)) / self.length
        ctx.info.update(fact=fact, echo=echo, summary=messages[0]["content"], answer=answer,
                        recall=recall)
        return recall


def imprint_examples(tok, letters: str = "abcd", faithful: float = 0.25,
                     seed: int = 0) -> list[tuple[str, str]]:
    """SFT pairs for a format prior (`molt_tools.imprint`): echo a lone user message; summarise
    [fact, echo, "s"] as the fact a `faithful` share of the time, as random letters otherwise."""
    rng = random.Random(seed)
    render = lambda m: tok.apply_chat_template(m, tokenize=False,       # noqa: E731
                                               add_generation_prompt=True)
    out = []
    for x in map("".join, itertools.product(letters, repeat=2)):
        out += [(render([{"role": "user", "content": x}]), x + "<|im_end|>")] * 4
        summary = render([{"role": "user", "content": x}, {"role": "assistant", "content": x},
                          {"role": "user", "content": "s"}])
        out += [(summary, (x if rng.random() < faithful else rng.choice(letters)
                           + rng.choice(letters)) + "<|im_end|>") for _ in range(8)]
    return out


@hookimpl
def molt_chat_agents() -> dict:
    return {"recall": Recall}
