"""Wire formats of the chat server: requests (OpenAI chat, OpenAI Responses, Anthropic messages)
-> template messages, and replies -> response objects.

Every malformed body is a `RequestError` (400) naming the field (`messages[0].content[1]`), never
a server traceback; so is sampling that differs from the run's (`check_sampling`)."""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Reply", "RequestError", "anthropic_messages", "anthropic_response", "check_depth",
           "check_sampling", "openai_messages", "openai_response", "parse_tool_calls",
           "responses_messages", "responses_response", "stop_strings", "text_of", "token_logprobs"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_DEPTH = 64
_REPRODUCIBLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")   # sampling.*
_UNSUPPORTED = ("frequency_penalty", "presence_penalty", "logit_bias")


class RequestError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Reply:
    text: str                       # the reply as sampled, minus a final stop token / stop text
    finish_reason: str              # stop | length
    prompt_tokens: int
    token_ids: list[int]            # the sampled tokens the trajectory holds for this reply
    logprobs: list[float]
    stop_sequence: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def _want(value: Any, kind: type | tuple, where: str) -> Any:
    if not isinstance(value, kind):
        names = {dict: "an object", list: "a list", str: "a string", int: "an integer"}
        want = " or ".join(names.get(k, k.__name__) for k in (kind if isinstance(kind, tuple)
                                                               else (kind,)))
        raise RequestError(400, f"'{where}' must be {want}, got {type(value).__name__}")
    return value


def check_depth(body: Any) -> None:
    """Reject JSON nested deeper than MAX_DEPTH (the template and cache walk it recursively)."""
    stack = [(body, 1)]
    while stack:
        v, d = stack.pop()
        if d > MAX_DEPTH:
            raise RequestError(400, f"the request body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, dict):
            stack += [(x, d + 1) for x in v.values()]
        elif isinstance(v, list):
            stack += [(x, d + 1) for x in v]


def check_sampling(body: dict, sampling: dict) -> None:
    """A sampling parameter the run cannot honour is a 400 naming the recipe key."""
    for key in _REPRODUCIBLE:
        v = body.get(key)
        if v is None or key not in sampling:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v - sampling[key]) <= 1e-6:
            raise RequestError(400, f"'{key}'={v!r} differs from the run's sampling "
                                    f"(sampling.{key}={sampling[key]}): behavior log-probs "
                                    f"must come from the run's sampling; drop '{key}' from the "
                                    f"request or set sampling.{key} in the recipe")
    for key in _UNSUPPORTED:
        if body.get(key):
            raise RequestError(400, f"'{key}' is not supported (the run's sampling is fixed by "
                                    "the recipe's sampling section); drop it from the request")


def stop_strings(body: dict, key: str) -> list[str]:
    if (stop := body.get(key)) is None:
        return []
    stop = [stop] if isinstance(stop, str) else _want(stop, list, key)
    for i, s in enumerate(stop):
        _want(s, str, f"{key}[{i}]")
    return [s for s in stop if s]


def text_of(content: Any, where: str) -> str:
    """OpenAI/Anthropic/Responses content (str or list of text parts) -> text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(_want(content, list, where)):
        w = f"{where}[{i}]"
        if isinstance(part, str):
            out.append(part)
            continue
        kind = _want(part, dict, w).get("type")
        if kind not in ("text", "input_text", "output_text"):
            raise RequestError(400, f"'{w}': unsupported content part {kind!r}: only text is "
                                    "supported here")
        out.append(_want(part.get("text", ""), str, f"{w}.text"))
    return "".join(out)


def _content(content: Any, where: str) -> str | list[dict]:
    """OpenAI content -> text, or text and image_url parts when it holds images."""
    if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        return text_of(content, where)
    parts: list[dict] = []
    for i, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            _want(url, str, f"{where}[{i}].image_url.url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": text_of([p], f"{where}[{i}:]")})
    return parts


def _role(m: Any, where: str, allowed: tuple[str, ...]) -> str:
    role = _want(m, dict, where).get("role")
    role = "system" if role == "developer" and "system" in allowed else role
    if role not in allowed:
        raise RequestError(400, f"'{where}.role': unsupported message role {role!r}")
    return role


def _messages_list(body: dict, key: str = "messages") -> list:
    if not isinstance(msgs := body.get(key), list) or not msgs:
        raise RequestError(400, f"'{key}' must be a non-empty list")
    return msgs


def _function_tools(tools: Any, where: str) -> list[dict] | None:
    for i, t in enumerate(_want(tools or [], list, where)):
        f = _want(_want(t, dict, f"{where}[{i}]").get("function"), dict, f"{where}[{i}].function")
        _want(f.get("name"), str, f"{where}[{i}].function.name")
    return tools or None


def openai_messages(body: dict) -> tuple[list[dict], list[dict] | None]:
    out = []
    for i, m in enumerate(_messages_list(body)):
        w = f"messages[{i}]"
        role = _role(m, w, ("system", "user", "assistant", "tool"))
        msg: dict[str, Any] = {"role": role, "content": _content(m.get("content"), f"{w}.content")}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = []
            for j, c in enumerate(_want(m["tool_calls"], list, f"{w}.tool_calls")):
                cw = f"{w}.tool_calls[{j}]"
                f = _want(_want(c, dict, cw).get("function"), dict, f"{cw}.function")
                msg["tool_calls"].append({"id": c.get("id"), "type": "function", "function": {
                    "name": _want(f.get("name"), str, f"{cw}.function.name"),
                    "arguments": _want(f.get("arguments", "{}"), (str, dict),
                                       f"{cw}.function.arguments")}})
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out, _function_tools(body.get("tools"), "tools")


def anthropic_messages(body: dict, raw_args: dict[str, str]) -> tuple[list[dict], list[dict] | None]:
    out: list[dict] = []
    if body.get("system"):
        out.append({"role": "system", "content": text_of(body["system"], "system")})
    for i, m in enumerate(_messages_list(body)):
        w = f"messages[{i}]"
        role, content = _role(m, w, ("user", "assistant")), m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else \
            _want(content or [], list, f"{w}.content")
        text: list = []
        calls, results = [], []
        for j, b in enumerate(blocks):
            bw = f"{w}.content[{j}]"
            kind = _want(b, dict, bw).get("type")
            if kind == "text":
                text.append(_want(b.get("text", ""), str, f"{bw}.text"))
            elif kind == "tool_use" and role == "assistant":
                raw = raw_args.get(b.get("id", ""))
                args: Any = raw if raw is not None and json.loads(raw) == b.get("input") \
                    else b.get("input", {})
                calls.append({"id": b.get("id"), "type": "function", "function": {
                    "name": _want(b.get("name"), str, f"{bw}.name"), "arguments": args}})
            elif kind == "image" and role == "user":
                src = b.get("source") or {}
                if not isinstance(src, dict) or src.get("type") != "base64":
                    raise RequestError(400, f"'{bw}': image blocks must carry base64 data (source "
                                            "type 'base64'): fetching remote images is not "
                                            "supported")
                text.append({"type": "image_url", "image_url": {
                    "url": f"data:{src.get('media_type', 'image/png')};base64,{src.get('data')}"}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                                "content": text_of(b.get("content"), f"{bw}.content")})
            else:
                raise RequestError(400, f"'{bw}': unsupported {role} content block {kind!r}")
        out += results
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not results:
            out.append({"role": "user", "content": _content(
                [{"type": "text", "text": t} if isinstance(t, str) else t for t in text], w)})
    tools = [{"type": "function", "function": {
        "name": _want(_want(t, dict, f"tools[{i}]").get("name"), str, f"tools[{i}].name"),
        "description": t.get("description", ""), "parameters": t.get("input_schema", {})}}
        for i, t in enumerate(_want(body.get("tools") or [], list, "tools"))]
    return out, tools or None


def responses_messages(body: dict) -> tuple[list[dict], list[dict] | None]:
    """OpenAI Responses `input` items (+ `instructions`) -> template messages; an assistant
    message and the function calls after it are one assistant turn (as sampled)."""
    out: list[dict] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": text_of(body["instructions"], "instructions")})
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else \
        _messages_list(body, "input")
    for i, it in enumerate(items):
        w = f"input[{i}]"
        kind = _want(it, dict, w).get("type", "message")
        if kind == "message":
            role = _role(it, w, ("system", "user", "assistant"))
            out.append({"role": role, "content": text_of(it.get("content"), f"{w}.content")})
        elif kind == "function_call":
            call = {"id": _want(it.get("call_id"), str, f"{w}.call_id"), "type": "function",
                    "function": {"name": _want(it.get("name"), str, f"{w}.name"), "arguments":
                                 _want(it.get("arguments", "{}"), str, f"{w}.arguments")}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it.get("call_id"),
                        "content": text_of(it.get("output"), f"{w}.output")})
        elif kind != "reasoning":            # we never emit reasoning items; others' are dropped
            raise RequestError(400, f"'{w}.type': unsupported input item {kind!r}")
    tools = []
    for i, t in enumerate(_want(body.get("tools") or [], list, "tools")):
        if _want(t, dict, f"tools[{i}]").get("type") != "function":
            raise RequestError(400, f"'tools[{i}].type': only function tools are supported, got "
                                    f"{t.get('type')!r}")
        f = {"name": _want(t.get("name"), str, f"tools[{i}].name")}
        f |= {k: t[k] for k in ("description", "parameters") if t.get(k) is not None}
        tools.append({"type": "function", "function": f})
    return out, tools or None


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, str, Any]], bool]:
    """Split a Hermes/Qwen reply: (content, [(name, raw_arguments_json, arguments)], malformed).

    `raw_arguments_json` is the arguments exactly as sampled, so that an SDK echoing the call back
    lets the template re-render the same text. Blocks that are not valid JSON with a `name` stay
    in the content and make `malformed` True (as does an unclosed `<tool_call>`)."""
    calls: list[tuple[str, str, Any]] = []
    first = None
    for m in _TOOL_CALL.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        raw = json.dumps(args, ensure_ascii=False)
        if (key := re.search(r'"arguments"\s*:\s*', body)) is not None:
            with contextlib.suppress(json.JSONDecodeError):
                value, end = json.JSONDecoder().raw_decode(body, key.end())
                if value == args:
                    raw = body[key.end():end]
        if isinstance(args, str):
            raw = args
        calls.append((obj["name"], raw, args))
        first = m.start() if first is None else first
    malformed = text.count("<tool_call>") != len(calls)
    return (text[:first].removesuffix("\n") if calls else text), calls, malformed


def token_logprobs(r: Reply, tokens: list[str], top: int) -> list[dict]:
    """Per sampled token (the final stop token included, as in the trajectory): its log-prob.
    The engine records only sampled tokens, so `top_logprobs` lists the sampled token alone."""
    out = []
    for t, lp in zip(tokens, r.logprobs):
        e = {"token": t, "logprob": lp, "bytes": list(t.encode())}
        out.append({**e, "top_logprobs": [e] if top else []})
    return out


def _call_id(prefix: str, raw: str, raw_args: dict[str, str]) -> str:
    """A new tool call id; `raw_args` keeps the call's arguments as sampled under it."""
    raw_args[cid := prefix + secrets.token_hex(8)] = raw
    return cid


def openai_response(r: Reply, content: str, calls: list, malformed: bool, model: str,
                    raw_args: dict[str, str], logprobs: list[dict] | None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        msg["tool_calls"] = [{"id": _call_id("call_", raw, raw_args), "type": "function",
                              "function": {"name": name, "arguments": raw}}
                             for name, raw, _ in calls]
    finish = "length" if r.finish_reason == "length" else "tool_calls" if calls else "stop"
    return {"id": "chatcmpl-" + secrets.token_hex(8), "object": "chat.completion",
            "created": int(time.time()), "model": model, "molt": {"malformed_tool_call": malformed},
            "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                         "logprobs": None if logprobs is None else {"content": logprobs}}],
            "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                      "total_tokens": r.prompt_tokens + r.completion_tokens}}


def anthropic_response(r: Reply, content: str, calls: list, malformed: bool, model: str,
                       raw_args: dict[str, str]) -> dict:
    blocks: list[dict] = [{"type": "text", "text": content}] if content or not calls else []
    blocks += [{"type": "tool_use", "id": _call_id("toolu_", raw, raw_args), "name": name,
                "input": args if isinstance(args, dict) else {"value": args}}
               for name, raw, args in calls]
    stop = ("max_tokens" if r.finish_reason == "length" else "tool_use" if calls
            else "stop_sequence" if r.stop_sequence else "end_turn")
    return {"id": "msg_" + secrets.token_hex(8), "type": "message", "role": "assistant",
            "model": model, "content": blocks, "stop_reason": stop,
            "molt": {"malformed_tool_call": malformed}, "stop_sequence": r.stop_sequence,
            "usage": {"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens}}


def responses_response(r: Reply, content: str, calls: list, malformed: bool, body: dict,
                       raw_args: dict[str, str], logprobs: list[dict] | None) -> dict:
    output: list[dict] = []
    if content or not calls:
        p = {"type": "output_text", "text": content, "annotations": [], "logprobs": logprobs or []}
        output.append({"type": "message", "id": "msg_" + secrets.token_hex(8), "status": "completed",
                       "role": "assistant", "content": [p]})
    output += [{"type": "function_call", "id": "fc_" + secrets.token_hex(8),
                "call_id": _call_id("call_", raw, raw_args), "name": name, "arguments": raw,
                "status": "completed"} for name, raw, _ in calls]
    incomplete = r.finish_reason == "length"
    return {"id": "resp_" + secrets.token_hex(8), "object": "response",
            "created_at": int(time.time()), "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "model": body.get("model") or "molt-policy", "output": output,
            "instructions": body.get("instructions"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": {},
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "molt": {"malformed_tool_call": malformed},
            "usage": {"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens,
                      "total_tokens": r.prompt_tokens + r.completion_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
