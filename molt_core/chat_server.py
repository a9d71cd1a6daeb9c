"""Loopback OpenAI + Anthropic compatible chat server with token-exact capture per rollout.

A chat agent is an ordinary program that talks to `base_url` with the stock `openai` or
`anthropic` SDK. Each rollout gets a *session* (`/s/{session}/...`, its own random bearer token);
the server renders each request with the model's chat template, generates in token space with the
rollout's `generate(prompt_ids, sampling) -> Completion`, and records the session's `Trajectory`:

- If a request's messages extend the previous request's messages and the new rendering starts
  with the text the session's tokens spell, only the new suffix is tokenized (masked) and
  appended; the sampled reply ids are appended unchanged (`add_completion`), never re-tokenized.
- Otherwise (e.g. a template that drops earlier `<think>` blocks re-renders history) a new
  *segment* starts: the full rendering is tokenized (masked) from that point, and the trainer
  treats each segment as its own sequence (`Trajectory.split_segments`).
- An identical retried request returns the cached reply and generates nothing.
- A prompt that does not fit the context returns `finish_reason: "length"` (Anthropic:
  `stop_reason: "max_tokens"`), generates nothing, and marks the rollout truncated.
- `stream: true` gets the same reply as server-sent events (`molt_core.chat_stream`).

Images (VL policies): OpenAI `image_url` content parts carrying base64 data URIs
(`data:image/png;base64,...`) and Anthropic base64 `image` blocks are decoded and rendered by the template as image placeholders; the
images ride with the trajectory (`molt_core.multimodal`). Remote URLs are refused (400).

Sampling is the run's (`sampling` given to `open_session`), never the request's: `temperature`,
`top_p`, `stop`, ... in a request are ignored, because behavior log-probs must come from the run's
explicit sampling. A request's `max_tokens` (or `max_completion_tokens`) only caps
`max_new_tokens`. With `tools`, Hermes/Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
blocks in the reply become OpenAI `tool_calls` / Anthropic `tool_use` blocks; the sampled tokens
stay as sampled. Tool results are rendered by the template and captured masked.

The server binds 127.0.0.1 only, on a random port. One server per process and event loop
(`shared_server()`), started lazily in the running loop (the generator's), so many sessions are
served concurrently on the loop where the rollouts run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import secrets
import socket
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from molt_core import multimodal
from molt_core.chat_stream import sse_events
from molt_core.trajectory import Completion, ImageInput, Trajectory

__all__ = ["ChatServer", "ChatSession", "parse_tool_calls", "shared_server", "shutdown_shared"]

GenerateFn = Callable[..., Awaitable[Completion]]   # (prompt_ids, sampling[, images])

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class _RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Reply:
    text: str                       # the reply as sampled, minus the final stop token
    finish_reason: str              # stop | length
    prompt_tokens: int
    completion_tokens: int


@dataclass
class ChatSession:
    """One rollout's conversation state; `trajectory` is what the trainer gets."""
    id: str
    api_key: str
    base_url: str                   # OpenAI SDK base_url (ends in /v1)
    anthropic_base_url: str         # Anthropic SDK base_url (the SDK appends /v1/messages)
    tokenizer: Any
    generate: GenerateFn
    sampling: dict
    max_context: int
    trajectory: Trajectory = field(default_factory=Trajectory)
    requests: int = 0               # requests answered, cached retries included
    generations: int = 0            # engine calls made
    _covered: str = ""              # the text the current segment's tokens spell
    _seg_start: int = 0
    _messages: list[dict] | None = None   # previous request's messages (normalized)
    _tools: list[dict] | None = None
    _cache: dict[str, dict] = field(default_factory=dict)
    _raw_args: dict[str, str] = field(default_factory=dict)  # tool call id -> arguments as sampled
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _images: multimodal.ImageEncoder | None = None

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)

    def _encode(self, text: str, messages: list[dict]) -> tuple[list[int], list[ImageInput]]:
        """Ids of `text` (the rendering of `messages`) and the images those messages hold."""
        try:
            images = multimodal.images_of(messages)
            if not images:
                return self.tokenizer(text, add_special_tokens=False).input_ids, []
            if self._images is None:
                self._images = multimodal.ImageEncoder(self.tokenizer.name_or_path,
                                                       self.tokenizer)
            return self._images.encode(text, images)
        except ValueError as e:    # a bad data URI, or images for a text-only model
            raise _RequestError(400, str(e)) from None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    async def turn(self, messages: list[dict], tools: list[dict] | None,
                   max_tokens: int | None) -> _Reply:
        """Render, extend the trajectory token-exactly (or start a segment), generate, record."""
        traj = self.trajectory
        rendered = self.render(messages, tools)
        prev = self._messages
        extends = (prev is not None and tools == self._tools and len(messages) > len(prev)
                   and messages[:len(prev)] == prev and rendered.startswith(self._covered)
                   and len(rendered) > len(self._covered))
        if extends:
            new_ids, new_images = self._encode(rendered[len(self._covered):],
                                               messages[len(prev):])
            seg_start = self._seg_start
        else:
            (new_ids, new_images), seg_start = self._encode(rendered, messages), len(traj)
        prompt = traj.token_ids[seg_start:] + new_ids
        room = self.max_context - len(prompt)
        if room < 1:
            traj.truncated = True
            traj.info["context_overflow"] = traj.info.get("context_overflow", 0) + 1
            return _Reply("", "length", len(prompt), 0)
        if not extends and len(traj):
            traj.segments.append(seg_start)
        self._seg_start = seg_start
        traj.add_prompt(new_ids, new_images)
        self._covered, self._messages, self._tools = rendered, messages, tools
        cap = self.sampling["max_new_tokens"] if max_tokens is None else max_tokens
        sampling = {**self.sampling,
                    "max_new_tokens": max(1, min(self.sampling["max_new_tokens"], cap, room))}
        images = [im.shifted(-seg_start) for im in traj.images if im.start >= seg_start]
        completion = await (self.generate(prompt, sampling, images) if images
                            else self.generate(prompt, sampling))
        self.generations += 1
        if completion.finish_reason == "abort":
            raise _RequestError(503, "the engine aborted the generation")
        start = len(traj)
        traj.add_completion(completion)
        traj.info.setdefault("turn_spans", []).append([start, len(traj)])
        ids = completion.token_ids
        self._covered += self._decode(ids)
        body = ids[:-1] if completion.finish_reason == "stop" and ids else ids
        return _Reply(self._decode(body), completion.finish_reason, len(prompt), len(ids))


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, str, Any]]]:
    """Split a Hermes/Qwen reply into (content, [(name, raw_arguments_json, arguments)]).

    `raw_arguments_json` is the arguments exactly as sampled, so that an SDK echoing the call back
    lets the template re-render the same text. Blocks that are not valid JSON with a `name` stay
    in the content.
    """
    calls: list[tuple[str, str, Any]] = []
    first = None
    for m in _TOOL_CALL.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        raw = json.dumps(args, ensure_ascii=False)
        key = re.search(r'"arguments"\s*:\s*', body)
        if key is not None:
            with contextlib.suppress(json.JSONDecodeError):
                value, end = json.JSONDecoder().raw_decode(body, key.end())
                if value == args:
                    raw = body[key.end():end]
        if isinstance(args, str):
            raw = args
        calls.append((obj["name"], raw, args))
        first = m.start() if first is None else first
    if not calls:
        return text, []
    content = text[:first]
    return content[:-1] if content.endswith("\n") else content, calls


def _text(content: Any) -> str:
    """OpenAI/Anthropic content (str or list of parts) -> text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                out.append(part.get("text", ""))
            else:
                raise _RequestError(400, f"unsupported content part {part.get('type')!r}: "
                                         "only text is supported")
        return "".join(out)
    raise _RequestError(400, f"unsupported message content {type(content).__name__}")


def _content(content: Any) -> str | list[dict]:
    """OpenAI content -> text, or text and image_url parts when it holds images."""
    if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        return _text(content)
    parts: list[dict] = []
    for p in content:
        if isinstance(p, dict) and p.get("type") == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise _RequestError(400, "image_url part without a url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text([p])})
    return parts


def _openai_messages(body: dict) -> tuple[list[dict], list[dict] | None]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _RequestError(400, "'messages' must be a non-empty list")
    out = []
    for m in msgs:
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise _RequestError(400, f"unsupported message role {role!r}")
        msg: dict[str, Any] = {"role": role, "content": _content(m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [
                {"id": c.get("id"), "type": "function",
                 "function": {"name": c["function"]["name"],
                              "arguments": c["function"].get("arguments", "{}")}}
                for c in m["tool_calls"]]
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    tools = body.get("tools") or None
    return out, tools


def _anthropic_messages(body: dict, raw_args: dict[str, str]) -> tuple[list[dict], list[dict] | None]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _RequestError(400, "'messages' must be a non-empty list")
    out: list[dict] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text(body["system"])})
    for m in msgs:
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise _RequestError(400, f"unsupported message role {role!r}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        text, calls, results = [], [], []
        for b in blocks:
            kind = b.get("type")
            if kind == "text":
                text.append(b.get("text", ""))
            elif kind == "tool_use" and role == "assistant":
                raw = raw_args.get(b.get("id", ""))
                args: Any = raw if raw is not None and json.loads(raw) == b.get("input") \
                    else b.get("input", {})
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"], "arguments": args}})
            elif kind == "image" and role == "user":
                src = b.get("source") or {}
                if src.get("type") != "base64":
                    raise _RequestError(400, "image blocks must carry base64 data (source type "
                                             "'base64'): fetching remote images is not supported")
                text.append({"type": "image_url", "image_url": {
                    "url": f"data:{src.get('media_type', 'image/png')};base64,{src.get('data')}"}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                                "content": _text(b.get("content"))})
            else:
                raise _RequestError(400, f"unsupported {role} content block {kind!r}")
        out += results
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not results:
            out.append({"role": "user", "content": _content(
                [{"type": "text", "text": t} if isinstance(t, str) else t for t in text])})
    tools = [{"type": "function", "function": {"name": t["name"],
                                                "description": t.get("description", ""),
                                                "parameters": t.get("input_schema", {})}}
             for t in body.get("tools") or []] or None
    return out, tools


def _max_tokens(body: dict) -> int | None:
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    if n is not None and (not isinstance(n, int) or n < 1):
        raise _RequestError(400, f"max_tokens must be a positive integer, got {n!r}")
    return n


class _Uvicorn:
    """uvicorn.Server that leaves signal handling to the host process."""

    def __new__(cls, config: Any) -> Any:
        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # type: ignore[override]
                yield

        return Server(config)


class ChatServer:
    """FastAPI app on 127.0.0.1:<random port>; sessions are opened and closed by the runner."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self.sessions: dict[str, ChatSession] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((self.host, 0))
        self._sock.listen(1024)
        self.port: int = self._sock.getsockname()[1]
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._started: asyncio.Future | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Serve on the running loop (idempotent; concurrent callers wait for the same start)."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            config = uvicorn.Config(self._app(), log_level="warning", access_log=False,
                                    lifespan="off", ws="none", timeout_graceful_shutdown=1)
            self._server = _Uvicorn(config)
            self._task = asyncio.get_running_loop().create_task(
                self._server.serve(sockets=[self._sock]))
            while not self._server.started:
                if self._task.done():
                    self._started.set_exception(RuntimeError(
                        f"chat server failed to start: {self._task.exception()!r}"))
                    break
                await asyncio.sleep(0.005)
            else:
                self._started.set_result(None)
        await asyncio.shield(self._started)

    async def close(self) -> None:
        """Stop accepting, finish in-flight requests (1 s grace), release the socket."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        self._sock.close()

    def open_session(self, tokenizer: Any, generate: GenerateFn, sampling: dict, *,
                     max_context: int) -> ChatSession:
        sid = secrets.token_hex(8)
        s = ChatSession(sid, "molt-" + secrets.token_urlsafe(24), f"{self.url}/s/{sid}/v1",
                        f"{self.url}/s/{sid}", tokenizer, generate, dict(sampling), max_context)
        self.sessions[sid] = s
        return s

    def close_session(self, session: ChatSession) -> Trajectory:
        """Forget the session (later requests get 404) and return its trajectory."""
        self.sessions.pop(session.id, None)
        traj = session.trajectory
        traj.info["chat_requests"] = session.requests
        traj.info["chat_generations"] = session.generations
        return traj

    def _session(self, sid: str, headers: Any) -> ChatSession:
        auth = headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        if not token:
            raise _RequestError(401, "missing credentials: send 'Authorization: Bearer <api_key>' "
                                     "or 'x-api-key: <api_key>' with the session's api_key")
        s = self.sessions.get(sid)
        if s is None:
            raise _RequestError(404, f"unknown chat session '{sid}' (closed, or never opened)")
        if not hmac.compare_digest(token.encode(), s.api_key.encode()):
            raise _RequestError(401, "invalid api_key for this session")
        return s

    async def _handle(self, api: str, sid: str, request: Any) -> tuple[dict, bool]:
        s = self._session(sid, request.headers)
        try:
            body = await request.json()
        except ValueError:
            raise _RequestError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise _RequestError(400, "the request body must be a JSON object")
        stream = bool(body.get("stream"))      # the reply is generated whole either way
        if body.get("n", 1) != 1:
            raise _RequestError(400, "only n=1 is supported: run one request per sample")
        key = json.dumps([api, body], sort_keys=True)
        async with s._lock:
            s.requests += 1
            if key in s._cache:
                return s._cache[key], stream
            if api == "openai":
                messages, tools = _openai_messages(body)
            else:
                messages, tools = _anthropic_messages(body, s._raw_args)
            reply = await s.turn(messages, tools, _max_tokens(body))
            content, calls = parse_tool_calls(reply.text) if tools else (reply.text, [])
            model = body.get("model") or "molt-policy"
            if api == "openai":
                resp = _openai_response(reply, content, calls, model, s._raw_args)
            else:
                resp = _anthropic_response(reply, content, calls, model, s._raw_args)
            s._cache[key] = resp
            return resp, stream

    def _app(self) -> Any:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        def error(api: str, e: _RequestError) -> JSONResponse:
            kind = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error"}.get(e.status, "api_error")
            if api == "anthropic":
                return JSONResponse({"type": "error", "error": {"type": kind, "message": str(e)}},
                                    status_code=e.status)
            return JSONResponse({"error": {"message": str(e), "type": kind, "code": e.status}},
                                status_code=e.status)

        async def serve(api: str, session: str, request: Request) -> Response:
            try:
                resp, stream = await self._handle(api, session, request)
            except _RequestError as e:
                return error(api, e)
            if stream:
                return StreamingResponse(sse_events(api, resp), media_type="text/event-stream")
            return JSONResponse(resp)

        @app.post("/s/{session}/v1/chat/completions")
        async def chat_completions(session: str, request: Request) -> Response:
            return await serve("openai", session, request)

        @app.post("/s/{session}/v1/messages")
        async def messages(session: str, request: Request) -> Response:
            return await serve("anthropic", session, request)

        return app


def _openai_response(r: _Reply, content: str, calls: list, model: str,
                     raw_args: dict[str, str]) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        msg["tool_calls"] = []
        for name, raw, _ in calls:
            cid = "call_" + secrets.token_hex(8)
            raw_args[cid] = raw
            msg["tool_calls"].append({"id": cid, "type": "function",
                                      "function": {"name": name, "arguments": raw}})
    finish = "length" if r.finish_reason == "length" else ("tool_calls" if calls else "stop")
    return {"id": "chatcmpl-" + secrets.token_hex(8), "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                      "total_tokens": r.prompt_tokens + r.completion_tokens}}


def _anthropic_response(r: _Reply, content: str, calls: list, model: str,
                        raw_args: dict[str, str]) -> dict:
    blocks: list[dict] = [{"type": "text", "text": content}] if content or not calls else []
    for name, raw, args in calls:
        cid = "toolu_" + secrets.token_hex(8)
        raw_args[cid] = raw
        blocks.append({"type": "tool_use", "id": cid, "name": name,
                       "input": args if isinstance(args, dict) else {"value": args}})
    stop = "max_tokens" if r.finish_reason == "length" else ("tool_use" if calls else "end_turn")
    return {"id": "msg_" + secrets.token_hex(8), "type": "message", "role": "assistant",
            "model": model, "content": blocks, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens}}


_servers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def shared_server() -> ChatServer:
    """The running loop's server, created and started on first use."""
    loop = asyncio.get_running_loop()
    server = _servers.get(loop)
    if server is None:
        server = _servers[loop] = ChatServer()
    await server.start()
    return server


async def shutdown_shared() -> None:
    """Close the running loop's shared server, if one was started (the generator's close)."""
    server = _servers.pop(asyncio.get_running_loop(), None)
    if server is not None:
        await server.close()
