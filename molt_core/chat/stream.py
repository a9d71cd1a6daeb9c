"""`stream: true` for the chat server: a finished reply as OpenAI chunks / Anthropic events (SSE).

The reply is generated whole, exactly as without streaming (same tokens, same trajectory), then
sent as the server-sent events the stock SDKs parse, built from the non-streaming response dict
so both paths stay identical."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

__all__ = ["sse_events"]

_PIECE = 8       # characters per text delta


def sse_events(api: str, resp: dict) -> Iterator[str]:
    return {"openai": _openai, "anthropic": _anthropic, "responses": _responses}[api](resp)


def _pieces(text: str) -> list[str]:
    return [text[i:i + _PIECE] for i in range(0, len(text), _PIECE)]


def _openai(resp: dict) -> Iterator[str]:
    choice = resp["choices"][0]
    msg = choice["message"]
    head = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"],
            "model": resp["model"]}

    def chunk(delta: dict, finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return "data: " + json.dumps({**head, "choices": [c], **extra}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for piece in _pieces(msg.get("content") or ""):
        yield chunk({"content": piece})
    for i, call in enumerate(msg.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"], choice["logprobs"], usage=resp["usage"])
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


def _responses(resp: dict) -> Iterator[str]:
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> str:
        return (f"event: {kind}\ndata: "
                f"{json.dumps({'type': kind, 'sequence_number': next(seq), **data})}\n\n")

    pending = {**resp, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for i, item in enumerate(resp["output"]):
        ids = {"output_index": i, "item_id": item["id"]}
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=i,
                        item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            yield event("response.content_part.added", **ids, content_index=0,
                        part={**part, "text": ""})
            for piece in _pieces(part["text"]):
                yield event("response.output_text.delta", **ids, content_index=0, delta=piece,
                            logprobs=[])
            yield event("response.output_text.done", **ids, content_index=0, text=part["text"],
                        logprobs=part["logprobs"])
            yield event("response.content_part.done", **ids, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=i,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **ids, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=i, item=item)
    yield event("response.completed" if resp["status"] == "completed" else "response.incomplete",
                response=resp)
