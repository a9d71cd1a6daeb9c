"""Loopback OpenAI + Anthropic compatible chat server with token-exact capture per rollout.

Each rollout gets a session (`/s/{session}/...`, its own bearer token); every request is rendered
with the model's chat template and generated in token space by the rollout's `generate`. A request
extending the previous one appends only its new text, tokenized and masked, then the sampled ids as
sampled (`add_completion`), never re-tokenized; otherwise (a template that re-renders history) a new
segment starts from the full rendering. See docs/agents.md, docs/plugins.md ("molt_chat_agents")."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import socket
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from molt_core import multimodal
from molt_core.chat import api as api_
from molt_core.chat.api import Reply, RequestError, parse_tool_calls
from molt_core.chat.stream import sse_events
from molt_core.multimodal import require_chat_template
from molt_core.trajectory import Completion, ImageInput, Trajectory

__all__ = ["ChatServer", "ChatSession", "parse_tool_calls", "shared_server", "shutdown_shared"]

GenerateFn = Callable[..., Awaitable[Completion]]   # (prompt_ids, sampling[, images])
MAX_BODY_BYTES = 8 * 2**20
_BIG = 256 * 2**10            # bodies above this are parsed and tokenized in a worker thread
_log = logging.getLogger("molt.chat_server")


@dataclass
class _Prep:
    """A request rendered and tokenized (no session state changed yet)."""
    rendered: str
    messages: list[dict]
    tools: list[dict] | None
    mode: str                       # extend | segment | resample
    ids: list[int]
    images: list[ImageInput]
    role: str = ""                  # metadata.molt_segment: a new role starts a new segment


@dataclass
class _Last:
    """The last reply, to undo it when the same messages are sent for a fresh sample."""
    start: int
    covered: str
    truncated: bool
    key: str = ""
    malformed: bool = False
    calls: int = 0


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
    max_body_bytes: int = MAX_BODY_BYTES
    # a policy other than the engine (a teacher, a script): (messages, tools) -> the assistant
    # message (OpenAI form), recorded as the tokens the template renders for it
    respond: Callable[[list[dict], list[dict] | None], Awaitable[dict]] | None = None
    trajectory: Trajectory = field(default_factory=Trajectory)
    requests: int = 0               # requests answered, cached retries included
    generations: int = 0            # engine calls made
    tool_calls: int = 0             # tool calls in the replies
    # per segment: its last request's messages and tools, the reply appended (SFT rows)
    conversations: list[dict] = field(default_factory=list)
    _covered: str = ""              # the text the current segment's tokens spell
    _seg_start: int = 0
    _messages: list[dict] | None = None   # previous request's messages (normalized)
    _tools: list[dict] | None = None
    _roles: list[str] = field(default_factory=lambda: [""])   # per segment (molt_segment)
    _last: _Last | None = None
    _cache: dict[str, dict] = field(default_factory=dict)
    _raw_args: dict[str, str] = field(default_factory=dict)  # tool call id -> arguments as sampled
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _encoder: multimodal.MessageEncoder | None = None

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The prompt text (`open_session` checked the tokenizer has a chat template)."""
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)

    def _encode(self, text: str, messages: list[dict]) -> tuple[list[int], list[ImageInput]]:
        """Ids of `text` (the rendering of `messages`) and the images those messages hold."""
        try:
            self._encoder = self._encoder or multimodal.MessageEncoder(self.tokenizer)
            return self._encoder(text, messages)
        except ValueError as e:    # a bad data URI, or images for a text-only model
            raise RequestError(400, str(e)) from None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def prepare(self, messages: list[dict], tools: list[dict] | None, role: str = "") -> _Prep:
        """Render and tokenize what the trajectory lacks; pure, so it may run in a thread."""
        rendered = self.render(messages, tools)
        if self._covered and not rendered.startswith(self._covered):
            # SDKs echo arguments as JSON text; templates that always `tojson` them (Qwen2.5's)
            # quote it, where the model sampled the object
            alt = self.render(_object_args(messages), tools)
            rendered = alt if alt.startswith(self._covered) else rendered
        prev, same = self._messages, tools == self._tools and role == self._roles[-1]
        if self._last is not None and messages == prev and same:
            return _Prep(rendered, messages, tools, "resample", [], [], role)
        extend = (prev is not None and same and len(messages) > len(prev)
                  and messages[:len(prev)] == prev and rendered.startswith(self._covered)
                  and len(rendered) > len(self._covered))
        text = rendered[len(self._covered):] if extend else rendered
        if len(text) > self.max_context:
            # Every token spells at most `longest` characters: a text this long cannot fit, and
            # tokenizing megabytes only to say so would take seconds.
            longest = max(map(len, self.tokenizer.get_vocab()))
            if len(text) > self.max_context * longest:
                raise RequestError(400, f"the prompt is at least {len(text) // longest} tokens "
                                        f"but the model's context is {self.max_context} tokens "
                                        "(max_position_embeddings): shorten the conversation",
                                   "context_length_exceeded")
        if extend:
            ids, images = self._encode(text, messages[len(prev):])
            return _Prep(rendered, messages, tools, "extend", ids, images, role)
        return _Prep(rendered, messages, tools, "segment", *self._encode(rendered, messages), role)

    def overflowed(self) -> None:
        t = self.trajectory
        t.truncated, t.info["context_overflow"] = True, t.info.get("context_overflow", 0) + 1

    def _rollback(self) -> None:
        """Drop the last reply's tokens (the prompt before it stays)."""
        t, last = self.trajectory, self._last
        assert last is not None
        for name in ("token_ids", "loss_mask", "logprobs", "versions", "routed_experts"):
            if getattr(t, name) is not None:
                del getattr(t, name)[last.start:]
        t.truncated = last.truncated
        t.info["turn_spans"].pop()
        t.calls.pop()
        t.info["resampled"] = t.info.get("resampled", 0) + 1
        if last.malformed:
            t.info["malformed_tool_calls"] -= 1
        self.tool_calls -= last.calls
        self._covered = last.covered
        self._cache.pop(last.key, None)

    def _cut(self, c: Completion, stop: list[str]) -> tuple[Completion, str | None]:
        """The completion before the first stop string in its text (a straddling token goes too)."""
        text = self._decode(c.token_ids)
        if not (hits := sorted((text.find(s), i, s) for i, s in enumerate(stop) if s in text)):
            return c, None
        pos, _, s = hits[0]
        k = 0
        while k < len(c.token_ids) and text[:pos].startswith(self._decode(c.token_ids[:k + 1])):
            k += 1
        routed = c.routed_experts[:k] if c.routed_experts is not None else None
        # "stop" even if the engine ran on to the cap: what followed the stop string is dropped
        return Completion(c.token_ids[:k], c.logprobs[:k], c.versions[:k], "stop", routed,
                          c.prompt_routed_experts), s

    def reply_ids(self, messages: list[dict], tools: list[dict] | None, reply: dict,
                  stop_ids: list[int]) -> list[int]:
        """The tokens the template renders for assistant message `reply` after `messages`, up to
        and with the first of `stop_ids` (where an engine sampling them stops)."""
        base = self.render(messages, tools)
        full = self.tokenizer.apply_chat_template([*messages, reply], tools=tools or None,
                                                  tokenize=False)
        if not full.startswith(base):
            raise RequestError(500, "the chat template renders the reply not as a continuation "
                                    "of its generation prompt: it cannot be recorded")
        ids = self.tokenizer.encode(full[len(base):], add_special_tokens=False)
        return ids[:next((k + 1 for k, t in enumerate(ids) if t in stop_ids), len(ids))]

    async def scripted(self, prep: _Prep) -> GenerateFn:
        """`respond`'s reply to `prep` as a completion: the tokens the template renders for it,
        through its end-of-turn token (log-prob 0, version 0: nothing trains on them)."""
        assert self.respond is not None
        msg, eos = await self.respond(prep.messages, prep.tools), self.tokenizer.eos_token_id
        ids = self.reply_ids(prep.messages, prep.tools, msg, [eos])
        ids += [] if ids[-1:] == [eos] else [eos]

        async def generate(*_: Any) -> Completion:
            return Completion(ids, [0.0] * len(ids), [0] * len(ids), "stop")
        return generate

    async def turn(self, prep: _Prep, max_tokens: int | None, stop: list[str] = (),
                   key: str = "", generate: GenerateFn | None = None) -> Reply:
        """Extend the trajectory (or start a segment, or replace the last reply); generate."""
        traj = self.trajectory
        if prep.mode == "resample":
            self._rollback()
        seg_start = len(traj) if prep.mode == "segment" else self._seg_start
        prompt = traj.token_ids[seg_start:] + prep.ids
        room = self.max_context - len(prompt)
        if room < 1:
            self.overflowed()
            raise RequestError(400, f"the prompt is {len(prompt)} tokens but the model's context "
                                    f"is {self.max_context} tokens (max_position_embeddings), "
                                    "which must leave room for a reply: shorten the conversation",
                               "context_length_exceeded")
        if prep.mode == "segment":
            traj.segments += [seg_start] if len(traj) else []
            self._roles[len(traj.segments) - 1:] = [prep.role]
        self._seg_start = seg_start
        traj.add_prompt(prep.ids, prep.images)
        self._covered, self._messages, self._tools = prep.rendered, prep.messages, prep.tools
        cap = self.sampling["max_new_tokens"] if max_tokens is None else max_tokens
        sampling = {**self.sampling,
                    "max_new_tokens": max(1, min(self.sampling["max_new_tokens"], cap, room))}
        images = [im.shifted(-seg_start) for im in traj.images if im.start >= seg_start]
        generate = generate or self.generate
        completion = await (generate(prompt, sampling, images) if images
                            else generate(prompt, sampling))
        self.generations += 1
        if completion.finish_reason == "abort":
            raise RequestError(503, "the engine aborted the generation")
        completion, stop_seq = self._cut(completion, list(stop))
        start = len(traj)
        self._last = _Last(start, self._covered, traj.truncated, key)
        traj.add_completion(completion)
        traj.info.setdefault("turn_spans", []).append([start, len(traj)])
        ids = completion.token_ids
        self._covered += self._decode(ids)
        eos = completion.finish_reason == "stop" and stop_seq is None and ids
        body = ids[:-1] if eos else ids
        return Reply(self._decode(body), completion.finish_reason, len(prompt), list(ids),
                     list(completion.logprobs), stop_seq)


def _object_args(messages: list[dict]) -> list[dict]:
    """`messages` with each tool call's JSON-text arguments as the object the text encodes."""
    def obj(call: dict) -> dict:
        f = call.get("function") or {}
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return {**call, "function": {**f, "arguments": json.loads(f["arguments"])}}
        return call
    return [{**m, "tool_calls": [obj(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def _max_tokens(body: dict, api: str) -> int | None:
    keys = {"openai": ("max_completion_tokens", "max_tokens"), "anthropic": ("max_tokens",),
            "responses": ("max_output_tokens",)}[api]
    n = next((body[k] for k in keys if body.get(k) is not None), None)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise RequestError(400, f"'{keys[-1]}' must be a positive integer, got {n!r}")
    return n


def _decode(api: str, raw: bytes) -> tuple[dict, str]:
    """The body, and its cache key (`stream` aside)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError(400, "the request body is not JSON (or is nested too deeply)") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    api_.check_depth(body)
    rest = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    key = json.dumps([api, rest], sort_keys=True, ensure_ascii=False)
    try:
        key.encode()
    except UnicodeEncodeError as e:
        raise RequestError(400, f"the request body holds a lone UTF-16 surrogate "
                                f"({key[e.start]!r}), which is not text: send valid "
                                "Unicode") from None
    return body, key


async def _read_body(request: Any, limit: int, timeout: float) -> bytes:
    too_big = RequestError(413, f"the request body is over this session's limit of {limit} "
                                "bytes (chat agent option max_request_mb)")
    n = request.headers.get("content-length", "")
    if n.isdigit() and int(n) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):       # a slow or stalled client holds no slot
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {timeout:g} s "
                                "(ChatServer body_timeout_s)") from None
    return b"".join(chunks)


class _Uvicorn(uvicorn.Server):
    """uvicorn.Server that leaves signal handling to the host process."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


def _quiet(record: logging.LogRecord) -> bool:     # close() cancels what is left on purpose
    return "graceful shutdown exceeded" not in f"{record.getMessage()} {record.exc_info}"


class _Protocol(H11Protocol):
    """h11 with a deadline on each request's head (uvicorn times out only idle keep-alives)."""

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_deadline()

    def _head_deadline(self) -> None:
        cycle = self.cycle      # still it, complete or None, when the timer fires: no new request
        self.loop.call_later(self.head_timeout_s, lambda: self.cycle is cycle and (
            cycle is None or cycle.response_complete) and self.timeout_keep_alive_handler())


class ChatServer:
    """FastAPI app on 127.0.0.1:<random port>; sessions are opened and closed by the runner."""

    host = "127.0.0.1"

    def __init__(self, port: int = 0, body_timeout_s: float = 30.0) -> None:
        self.sessions: dict[str, ChatSession] = {}
        self.body_timeout_s = body_timeout_s
        self.dropped: Counter[str] = Counter()     # requests lost to their client, by class
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((self.host, port))
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
            protocol = type("Protocol", (_Protocol,), {"head_timeout_s": self.body_timeout_s})
            config = uvicorn.Config(self._app(), log_level="warning", access_log=False, ws="none",
                                    lifespan="off", timeout_graceful_shutdown=1, http=protocol)
            logging.getLogger("uvicorn.error").addFilter(_quiet)     # after Config's dictConfig
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
                     max_context: int, max_body_bytes: int = MAX_BODY_BYTES,
                     respond: Callable | None = None) -> ChatSession:
        require_chat_template(tokenizer)
        sid = secrets.token_hex(8)
        s = ChatSession(sid, "molt-" + secrets.token_urlsafe(24), f"{self.url}/s/{sid}/v1",
                        f"{self.url}/s/{sid}", tokenizer, generate, dict(sampling), max_context,
                        max_body_bytes, respond)
        self.sessions[sid] = s
        return s

    def close_session(self, session: ChatSession) -> Trajectory:
        """Forget the session (later requests get 404) and return its trajectory."""
        self.sessions.pop(session.id, None)
        traj = session.trajectory
        traj.info.update(chat_requests=session.requests, chat_generations=session.generations,
                         chat_tool_calls=session.tool_calls)
        if any(session._roles):         # the links between segments (docs/agents.md, Compaction)
            traj.info["segment_roles"] = session._roles
        return traj

    def _session(self, sid: str, headers: Any) -> ChatSession:
        auth = headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        if not token:
            raise RequestError(401, "missing credentials: send 'Authorization: Bearer <api_key>' "
                                    "or 'x-api-key: <api_key>' with the session's api_key")
        if (s := self.sessions.get(sid)) is None:
            raise RequestError(404, f"unknown chat session '{sid}' (closed, or never opened)")
        if not hmac.compare_digest(token.encode(), s.api_key.encode()):
            raise RequestError(401, "invalid api_key for this session")
        return s

    async def _handle(self, api: str, sid: str, request: Any) -> tuple[dict, bool]:
        s = self._session(sid, request.headers)
        raw = await _read_body(request, s.max_body_bytes, self.body_timeout_s)
        big = len(raw) > _BIG
        body, key = await asyncio.to_thread(_decode, api, raw) if big else _decode(api, raw)
        stream = bool(body.get("stream"))      # the reply is generated whole either way
        if body.get("n", 1) != 1:
            raise RequestError(400, "only n=1 is supported: run one request per sample")
        api_.check_sampling(body, s.sampling)
        async with s._lock:
            s.requests += 1
            if key in s._cache:
                return s._cache[key], stream
            parse = {"openai": api_.openai_messages, "responses": api_.responses_messages}.get(api)
            messages, tools = parse(body) if parse else api_.anthropic_messages(body, s._raw_args)
            stop = api_.stop_strings(body, "stop_sequences" if api == "anthropic" else "stop")
            meta = body.get("metadata") or {}
            role = meta.get("molt_segment", "") if isinstance(meta, dict) else None
            if not isinstance(role, str):
                raise RequestError(400, "'metadata' must be an object, its molt_segment a string")
            try:
                prep = (await asyncio.to_thread(s.prepare, messages, tools, role) if big
                        else s.prepare(messages, tools, role))
            except RequestError as e:
                if e.code == "context_length_exceeded":
                    s.overflowed()
                raise
            reply = await s.turn(prep, _max_tokens(body, api), stop, key,
                                 s.respond and await s.scripted(prep))
            content, calls, malformed = (parse_tool_calls(reply.text) if tools
                                         else (reply.text, [], False))
            assert s._last is not None
            s._last.malformed, s._last.calls = malformed, len(calls)
            if malformed:
                info = s.trajectory.info
                info["malformed_tool_calls"] = info.get("malformed_tool_calls", 0) + 1
            s.tool_calls += len(calls)
            s._cache[key] = resp = self._response(api, s, body, reply, content, calls, malformed)
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:       # the ids `_response` gave them, the last ones in `_raw_args`
                msg["tool_calls"] = [{"id": i, "type": "function", "function": {
                    "name": n, "arguments": raw}} for i, (n, raw, _) in
                    zip(list(s._raw_args)[-len(calls):], calls)]
            conv = {"messages": [*messages, msg], "tools": tools}
            s.conversations[len(s.conversations) - (prep.mode != "segment"):] = [conv]
            return resp, stream

    @staticmethod
    def _response(api: str, s: ChatSession, body: dict, reply: Reply, content: str,
                  calls: list, malformed: bool) -> dict:
        if api == "anthropic":
            return api_.anthropic_response(reply, content, calls, malformed,
                                           body.get("model") or "molt-policy", s._raw_args)
        top = body.get("top_logprobs") or 0
        want = body.get("logprobs") if api == "openai" else (
            "top_logprobs" in body or "message.output_text.logprobs" in (body.get("include") or []))
        lps = api_.token_logprobs(reply, [s._decode([t]) for t in reply.token_ids], top) \
            if want else None
        if api == "openai":
            return api_.openai_response(reply, content, calls, malformed,
                                        body.get("model") or "molt-policy", s._raw_args, lps)
        return api_.responses_response(reply, content, calls, malformed, body, s._raw_args, lps)

    def _drop(self, kind: str, what: str) -> None:
        """One log line per class of lost request (a flood of them is no log flood)."""
        self.dropped[kind] += 1
        if self.dropped[kind] == 1:
            _log.warning("chat server: %s (logged once; ChatServer.dropped counts them)", what)

    def _app(self) -> Any:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        def error(api: str, e: RequestError) -> JSONResponse:
            kind = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 413: "invalid_request_error"}.get(e.status, "api_error")
            if api == "anthropic":
                return JSONResponse({"type": "error", "error": {"type": kind, "message": str(e)}},
                                    status_code=e.status)
            err = {"message": str(e), "type": kind, "code": e.code or e.status, "param": None}
            return JSONResponse({"error": err}, status_code=e.status)

        def endpoint(api: str) -> Callable:
            async def post(session: str, request: Request) -> Response:
                try:
                    resp, stream = await self._handle(api, session, request)
                except ClientDisconnect:
                    self._drop("disconnect", "a client left before sending its whole request body")
                    return Response(status_code=400)
                except RequestError as e:
                    if e.status == 408:
                        self._drop("body_timeout", str(e))
                    return error(api, e)
                except Exception as e:     # one logged traceback and a clean 500, never ASGI noise
                    _log.exception("chat server: %s request failed", api)
                    return error(api, RequestError(500, f"internal error: {e!r}"))
                return (StreamingResponse(sse_events(api, resp), media_type="text/event-stream")
                        if stream else JSONResponse(resp))
            return post

        for path, api in (("chat/completions", "openai"), ("responses", "responses"),
                          ("messages", "anthropic")):
            app.post(f"/s/{{session}}/v1/{path}")(endpoint(api))

        @app.get("/s/{session}/v1/models")
        @app.get("/s/{session}/v1/models/{model}")
        async def models(session: str, request: Request, model: str = "molt-policy") -> Response:
            try:
                self._session(session, request.headers)
            except RequestError as e:
                return error("openai", e)
            card = {"id": model, "object": "model", "created": 0, "owned_by": "molt"}
            return JSONResponse(card if "model" in request.path_params
                                else {"object": "list", "data": [card]})

        return app


_servers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def shared_server() -> ChatServer:
    """The running loop's server, created and started on first use."""
    loop = asyncio.get_running_loop()
    server = _servers[loop] = _servers.get(loop) or ChatServer()
    await server.start()
    return server


async def shutdown_shared() -> None:
    """Close the running loop's shared server, if one was started (the chat agent's `aclose`)."""
    if (server := _servers.pop(asyncio.get_running_loop(), None)) is not None:
        await server.close()
