"""Context compaction by the policy itself: docs/agents.md, Compaction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Compactor"]


@dataclass
class Compactor:
    """`messages = await compactor(client, model, messages, last.usage)` before each call: over
    budget, the policy summarises all but the last `keep` messages in a call tagged `metadata=
    {"molt_segment": "summary"}` (its own segment), then [system, summary, *recent] go on."""
    max_messages: int | None = None     # budget: messages after the system message
    max_tokens: int | None = None       # budget: the last call's usage.total_tokens
    keep: int = 2
    instruction: str = "Summarise the conversation so far; keep every fact still needed."
    prefix: str = "Summary of the conversation so far: "
    summary_tokens: int | None = None   # max_tokens of the summary call

    async def __call__(self, client: Any, model: str, messages: list[dict],
                       usage: Any = None) -> list[dict]:
        head = messages[:1] if messages and messages[0]["role"] == "system" else []
        if not (self.max_messages is not None and len(messages) - len(head) > self.max_messages
                or self.max_tokens is not None and usage and usage.total_tokens > self.max_tokens):
            return messages
        cut = max(len(head), len(messages) - self.keep)
        while len(head) < cut < len(messages) and messages[cut]["role"] == "tool":
            cut -= 1                    # a tool result stays with the call that asked for it
        r = await client.chat.completions.create(
            model=model, messages=[*messages[:cut], {"role": "user", "content": self.instruction}],
            max_tokens=self.summary_tokens, metadata={"molt_segment": "summary"})
        summary = {"role": "user", "content": self.prefix + (r.choices[0].message.content or "")}
        return [*head, summary, *messages[cut:]]
