"""`stream: true` for the chat server: a finished reply as OpenAI chunks / Anthropic events (SSE).

The reply is generated whole, exactly as without streaming (same tokens, same trajectory), then
sent as the server-sent events the stock SDKs parse: OpenAI `chat.completion.chunk`s ending in
`data: [DONE]`; Anthropic `message_start`, per block `content_block_start/delta/stop`
(`text_delta`, or one `input_json_delta` with a tool call's input), `message_delta`,
`message_stop`. Built from the non-streaming response dict, so both paths stay identical.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

__all__ = ["sse_events"]

_PIECE = 8       # characters per text delta


def sse_events(api: str, resp: dict) -> Iterator[str]:
    return _openai(resp) if api == "openai" else _anthropic(resp)


def _pieces(text: str) -> list[str]:
    return [text[i:i + _PIECE] for i in range(0, len(text), _PIECE)]


def _openai(resp: dict) -> Iterator[str]:
    choice = resp["choices"][0]
    msg = choice["message"]
    head = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"],
            "model": resp["model"]}

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> str:
        return "data: " + json.dumps({**head, "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            **extra}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for piece in _pieces(msg.get("content") or ""):
        yield chunk({"content": piece})
    for i, call in enumerate(msg.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"], usage=resp["usage"])
    yield "data: [DONE]\n\n"


def _anthropic(resp: dict) -> Iterator[str]:
    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    usage = resp["usage"]
    yield event("message_start", message={**resp, "content": [], "stop_reason": None,
                                          "usage": {**usage, "output_tokens": 0}})
    for i, block in enumerate(resp["content"]):
        if block["type"] == "text":
            yield event("content_block_start", index=i, content_block={"type": "text", "text": ""})
            for piece in _pieces(block["text"]):
                yield event("content_block_delta", index=i,
                            delta={"type": "text_delta", "text": piece})
        else:
            yield event("content_block_start", index=i, content_block={**block, "input": {}})
            yield event("content_block_delta", index=i, delta={
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield event("content_block_stop", index=i)
    yield event("message_delta", delta={"stop_reason": resp["stop_reason"], "stop_sequence": None},
                usage={"output_tokens": usage["output_tokens"]})
    yield event("message_stop")
