"""Loopback chat server: real openai/anthropic SDKs, real uvicorn, real HFEngine on the tiny model.

Also API coverage and limits: models list, the Responses API (and the stock OpenAI Agents SDK),
logprobs, stop, sampling mismatch, malformed tool calls, fresh samples, body limits, malformed
bodies, a missing chat template.

Token identity is checked against a recorder around the engine's `generate` (the ids the engine
returned, in call order). Tool-call tests use a tiny model imprinted in-test (a few SFT steps) to
emit a fixed Hermes tool call, because a random-init model never emits valid JSON.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
import torch
from transformers import AutoTokenizer

from molt_core.advantage import training_batch
from molt_core.chat.server import ChatServer, parse_tool_calls
from molt_core.config import AlgorithmConfig
from molt_core.consistency import consistency_tol
from molt_core.engines.hf import HFEngine
from molt_core.trajectory import Completion
from molt_gigpo import gigpo_advantages
from molt_tools.testing import _ZeroCritic
from molt_turn_rloo import turn_rloo_advantages

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
ANTHROPIC_TOOL = {"name": "calculator", "description": "Evaluate an arithmetic expression",
                  "input_schema": TOOL["function"]["parameters"]}
QUESTION = "What is 3 + 4? Use the calculator."
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
ANSWER = "The answer is 7."

# Thinking template in the style of reasoning models: the generation prompt opens `<think>`, and
# earlier assistant turns are re-rendered without their reasoning (text up to `</think>`).
THINK_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content.split('</think>')[-1] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}
"""


def sampling(tok, **kw) -> dict:
    # Stop on <|im_end|> only, so every reply ends the way the template renders it.
    return {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
            "max_new_tokens": 12, "stop_token_ids": [tok.convert_tokens_to_ids("<|im_end|>")], **kw}


class Recorder:
    """The engine's generate, recording every Completion it returned (in order)."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.calls = engine, []

    async def __call__(self, prompt_ids: list[int], sampling: dict) -> Completion:
        c = await self.engine.generate(prompt_ids, sampling)
        self.calls.append((list(prompt_ids), c))
        return c


def runs(traj) -> list[tuple[bool, list[int], list[float]]]:
    """Split a trajectory into maximal runs of equal loss_mask: (trainable, ids, logprobs)."""
    out = []
    for i, (t, m, lp) in enumerate(zip(traj.token_ids, traj.loss_mask, traj.logprobs)):
        if out and out[-1][0] == m and i not in traj.segments:
            out[-1][1].append(t)
            out[-1][2].append(lp)
        else:
            out.append((m, [t], [lp]))
    return out


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def assert_token_exact(tok, traj, rec: Recorder, rendered: list[str]) -> None:
    """Trainable runs are exactly the engine's completions; each masked run decodes to the part
    of the template rendering that the previous tokens did not already cover."""
    traj.check(len(tok))
    parts = runs(traj)
    trainable = [p for p in parts if p[0]]
    assert [p[1] for p in trainable] == [c.token_ids for _, c in rec.calls]
    assert [p[2] for p in trainable] == [c.logprobs for _, c in rec.calls]
    masked = [p for p in parts if not p[0]]
    assert len(masked) == len(rendered)
    covered = ""
    seg = 0
    k = 0
    for i, (m, ids, _) in enumerate(parts):
        start = sum(len(p[1]) for p in parts[:i])
        if start in traj.segments:
            covered, seg = "", seg + 1
        if m:
            covered += decode(tok, ids)
        else:
            assert rendered[k].startswith(covered)
            assert decode(tok, ids) == rendered[k][len(covered):]
            covered = rendered[k]
            k += 1
    # What the engine saw for each call is the trajectory's current segment up to that point.
    for prompt, c in rec.calls:
        pos = next(i for i in range(len(traj)) if traj.token_ids[i:i + len(c.token_ids)]
                   == c.token_ids and traj.loss_mask[i])
        seg_start = max(s for s in traj.segments if s <= pos)
        assert traj.token_ids[seg_start:pos] == prompt


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(coro):
    return asyncio.run(coro)


async def started() -> ChatServer:
    server = ChatServer()
    await server.start()
    return server


async def both_sdks(model_dir, openai_side, anthropic_side) -> tuple[list, list]:
    """The OpenAI and the Anthropic conversation at once, each on its own Recorder of one engine."""
    server = await started()
    engine = HFEngine(str(model_dir))
    recs = [Recorder(engine), Recorder(engine)]
    trajs = await asyncio.gather(openai_side(server, recs[0]), anthropic_side(server, recs[1]))
    await server.close()
    return trajs, recs


def render(tok, messages, tools=None) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def test_openai_multi_turn_token_exact(tiny_model_dir, tok):
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(tiny_model_dir), seed=1))
        s = server.open_session(tok, rec, sampling(tok), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        messages, rendered = [{"role": "system", "content": "be brief"}], []
        for turn in range(3):
            messages.append({"role": "user", "content": f"question {turn}"})
            rendered.append(render(tok, messages))
            r = await client.chat.completions.create(model="policy", messages=messages)
            assert r.usage.completion_tokens == len(rec.calls[-1][1].token_ids)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return traj, rec, rendered

    traj, rec, rendered = run(main())
    assert traj.segments == [0] and len(rec.calls) == 3
    assert_token_exact(tok, traj, rec, rendered)


def test_anthropic_multi_turn_token_exact(tiny_model_dir, tok):
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(tiny_model_dir), seed=2))
        s = server.open_session(tok, rec, sampling(tok), max_context=512)
        client = anthropic.AsyncAnthropic(base_url=s.anthropic_base_url, api_key=s.api_key,
                                          max_retries=0)
        messages, rendered = [], []
        for turn in range(3):
            messages.append({"role": "user", "content": [{"type": "text", "text": f"q{turn}"}]})
            rendered.append(render(tok, [{"role": "system", "content": "be brief"}]
                                   + [{"role": m["role"], "content": m["content"][0]["text"]}
                                      for m in messages]))
            r = await client.messages.create(model="policy", system="be brief", max_tokens=10,
                                             messages=messages)
            assert r.usage.output_tokens == len(rec.calls[-1][1].token_ids) <= 10
            messages.append({"role": "assistant", "content": [b.model_dump() for b in r.content]})
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return traj, rec, rendered

    traj, rec, rendered = run(main())
    assert traj.segments == [0] and len(rec.calls) == 3
    assert_token_exact(tok, traj, rec, rendered)


def test_reasoning_dropping_template_segments_and_retry(tiny_model_dir, tok):
    think_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    think_tok.chat_template = THINK_TEMPLATE

    async def main():
        server, rec = await started(), Recorder(HFEngine(str(tiny_model_dir), seed=3))
        s = server.open_session(think_tok, rec, sampling(tok), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        messages, rendered = [{"role": "user", "content": "first"}], []
        rendered.append(render(think_tok, messages))
        r1 = await client.chat.completions.create(model="p", messages=messages)
        messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "second"}]
        rendered.append(render(think_tok, messages))
        r2 = await client.chat.completions.create(model="p", messages=messages)
        n_tokens, n_calls = len(s.trajectory), len(rec.calls)
        again = await client.chat.completions.create(model="p", messages=messages)
        assert again.model_dump() == r2.model_dump()
        assert (len(s.trajectory), len(rec.calls), s.requests) == (n_tokens, n_calls, 3)
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return traj, rec, rendered

    traj, rec, rendered = run(main())
    assert len(traj.segments) == 2 and len(rec.calls) == 2
    assert_token_exact(think_tok, traj, rec, rendered)
    # The second segment is a fresh rendering: it starts with the template's first message.
    seg1 = traj.token_ids[traj.segments[1]:]
    assert decode(tok, seg1).startswith(rendered[1])
    parts = traj.split_segments()
    assert [len(p) for p in parts] == [traj.segments[1], len(traj) - traj.segments[1]]
    for p in parts:
        p.check(len(tok))


def test_context_overflow_is_a_400_naming_both_lengths(tiny_model_dir, tok):
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(tiny_model_dir)))
        s = server.open_session(tok, rec, sampling(tok), max_context=40)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "hello " * 50}])
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return e.value, traj, rec

    err, traj, rec = run(main())
    n = len(tok(render(tok, [{"role": "user", "content": "hello " * 50}]),
                add_special_tokens=False).input_ids)
    assert err.code == "context_length_exceeded"
    assert f"the prompt is {n} tokens" in err.message and "context is 40 tokens" in err.message
    assert traj.truncated and traj.info["context_overflow"] == 1 and not rec.calls


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tok, tmp_path_factory) -> Path:
    """The tiny model, imprinted to call the calculator for QUESTION, then answer."""
    from molt_tools.imprint import imprint

    q = [{"role": "user", "content": QUESTION}]
    p1 = render(tok, q, [TOOL])
    done = q + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "3 + 4"}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "7"}]
    p2 = render(tok, done, [TOOL])
    return imprint(tiny_model_dir, tmp_path_factory.mktemp("calc"),
                   [(p1, CALL + "<|im_end|>"), (p2, ANSWER + "<|im_end|>")], tol=0.005)


def test_tool_calls_round_trip_both_sdks(tool_model_dir, tok):
    cold = sampling(tok, temperature=0.05, max_new_tokens=40)

    async def openai_side(server, rec):
        s = server.open_session(tok, rec, cold, max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        r = await client.chat.completions.create(model="p", messages=messages, tools=[TOOL])
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        (call,) = msg.tool_calls
        assert call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "3 + 4"}
        messages += [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        r = await client.chat.completions.create(model="p", messages=messages, tools=[TOOL])
        assert r.choices[0].message.content == ANSWER
        await client.close()
        return server.close_session(s)

    async def anthropic_side(server, rec):
        s = server.open_session(tok, rec, cold, max_context=512)
        client = anthropic.AsyncAnthropic(base_url=s.anthropic_base_url, api_key=s.api_key,
                                          max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        r = await client.messages.create(model="p", max_tokens=40, messages=messages,
                                         tools=[ANTHROPIC_TOOL])
        assert r.stop_reason == "tool_use"
        (use,) = r.content
        assert (use.type, use.name, use.input) == ("tool_use", "calculator", {"expression": "3 + 4"})
        messages += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "7"}]}]
        r = await client.messages.create(model="p", max_tokens=40, messages=messages,
                                         tools=[ANTHROPIC_TOOL])
        assert r.content[0].text == ANSWER and r.stop_reason == "end_turn"
        await client.close()
        return server.close_session(s)

    trajs, recs = run(both_sdks(tool_model_dir, openai_side, anthropic_side))
    for traj, rec in zip(trajs, recs):
        assert traj.segments == [0], "the echoed tool call re-renders exactly as sampled"
        assert decode(tok, rec.calls[0][1].token_ids) == CALL + "<|im_end|>"
        parts = runs(traj)
        assert [p[0] for p in parts] == [False, True, False, True]
        assert [p[1] for p in parts if p[0]] == [c.token_ids for _, c in rec.calls]
        tool_text = decode(tok, parts[2][1])
        assert "<tool_response>\n7\n</tool_response>" in tool_text and not parts[2][0]


def test_sdk_json_text_arguments_re_render_under_a_template_that_tojsons_them(tok):
    """The OpenAI SDK echoes a call's arguments as JSON text; templates that always `tojson` them
    (Qwen2.5's) would render that text as a quoted string. The server renders the object the
    text encodes instead, so the history still extends what was sampled (one segment). Scripted
    engine: the tiny random-init model never emits a tool call."""
    qwen25 = AutoTokenizer.from_pretrained(tok.name_or_path)
    qwen25.chat_template = tok.chat_template.replace(
        "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}", "{%- if false %}")
    assert qwen25.chat_template != tok.chat_template
    replies = [CALL + "<|im_end|>", ANSWER + "<|im_end|>"]
    sampled = []

    async def generate(prompt_ids: list[int], sampling: dict) -> Completion:
        ids = qwen25.encode(replies[len(sampled)], add_special_tokens=False)
        sampled.append(ids)
        return Completion(ids, [-0.5] * len(ids), [0] * len(ids))

    async def main():
        server = ChatServer()
        await server.start()
        s = server.open_session(qwen25, generate, sampling(qwen25, max_new_tokens=40),
                                max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        r = await client.chat.completions.create(model="p", messages=messages, tools=[TOOL])
        (call,) = r.choices[0].message.tool_calls
        assert isinstance(call.function.arguments, str)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        r = await client.chat.completions.create(model="p", messages=messages, tools=[TOOL])
        assert r.choices[0].message.content == ANSWER
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return traj

    traj = run(main())
    assert traj.segments == [0]
    assert [t for t, m in zip(traj.token_ids, traj.loss_mask) if m] == sampled[0] + sampled[1]


def test_streaming_tool_calls_both_sdks(tool_model_dir, tok):
    """stream=True through both SDKs: the SDKs assemble the tool call and the answer from the
    event stream, and the trajectory is token-exact as without streaming."""
    cold = sampling(tok, temperature=0.05, max_new_tokens=40)

    async def openai_side(server, rec):
        s = server.open_session(tok, rec, cold, max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)

        async def ask(messages):
            text, calls, finish = "", {}, None
            async for chunk in await client.chat.completions.create(
                    model="p", messages=messages, tools=[TOOL], stream=True):
                delta = chunk.choices[0].delta
                text += delta.content or ""
                for c in delta.tool_calls or []:
                    calls[c.index] = c
                finish = chunk.choices[0].finish_reason or finish
            return text, list(calls.values()), finish

        messages = [{"role": "user", "content": QUESTION}]
        text, (call,), finish = await ask(messages)
        assert finish == "tool_calls" and text == "" and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "3 + 4"}
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": call.id, "type": "function", "function": {
                             "name": "calculator", "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        assert await ask(messages) == (ANSWER, [], "stop")
        await client.close()
        return server.close_session(s)

    async def anthropic_side(server, rec):
        s = server.open_session(tok, rec, cold, max_context=512)
        client = anthropic.AsyncAnthropic(base_url=s.anthropic_base_url, api_key=s.api_key,
                                          max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        async with client.messages.stream(model="p", max_tokens=40, messages=messages,
                                          tools=[ANTHROPIC_TOOL]) as stream:
            r = await stream.get_final_message()
        (use,) = r.content
        assert r.stop_reason == "tool_use"
        assert (use.type, use.name, use.input) == ("tool_use", "calculator", {"expression": "3 + 4"})
        messages += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "7"}]}]
        async with client.messages.stream(model="p", max_tokens=40, messages=messages,
                                          tools=[ANTHROPIC_TOOL]) as stream:
            texts = [t async for t in stream.text_stream]
            r = await stream.get_final_message()
        assert "".join(texts) == r.content[0].text == ANSWER and len(texts) > 1
        assert r.stop_reason == "end_turn" and r.usage.output_tokens == len(rec.calls[1][1].token_ids)
        await client.close()
        return server.close_session(s)

    trajs, recs = run(both_sdks(tool_model_dir, openai_side, anthropic_side))
    for traj, rec in zip(trajs, recs):
        assert traj.segments == [0] and len(rec.calls) == 2
        parts = runs(traj)
        assert [p[0] for p in parts] == [False, True, False, True]
        assert [p[1] for p in parts if p[0]] == [c.token_ids for _, c in rec.calls]
        assert [p[2] for p in parts if p[0]] == [c.logprobs for _, c in rec.calls]


def test_parse_tool_calls_keeps_raw_arguments():
    text = 'ok\n<tool_call>\n{"name": "f", "arguments": {"a":1,  "b": [2]}}\n</tool_call>'
    content, calls, malformed = parse_tool_calls(text)
    assert content == "ok" and calls == [("f", '{"a":1,  "b": [2]}', {"a": 1, "b": [2]})]
    assert not malformed
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [], True)
    assert parse_tool_calls("<tool_call>{")[2] and not parse_tool_calls("no call")[2]


def _post(url: str, headers: dict) -> int:
    req = urllib.request.Request(url, data=json.dumps({"model": "p", "messages": [
        {"role": "user", "content": "hi"}]}).encode(), headers={"content-type": "application/json",
                                                                 **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _other_addresses() -> list[str]:
    addrs = {"127.0.0.2"}   # another loopback address: a 127.0.0.1-only bind refuses it
    try:
        addrs |= {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        pass
    return sorted(a for a in addrs if a != "127.0.0.1")


def test_auth_unknown_session_and_loopback_only(tiny_model_dir, tok):
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(tiny_model_dir)))
        s = server.open_session(tok, rec, sampling(tok, max_new_tokens=2), max_context=512)
        other = server.open_session(tok, rec, sampling(tok), max_context=512)
        url = s.base_url + "/chat/completions"
        codes = {
            "none": await asyncio.to_thread(_post, url, {}),
            "bad": await asyncio.to_thread(_post, url, {"authorization": "Bearer nope"}),
            "other_session_key": await asyncio.to_thread(
                _post, url, {"authorization": f"Bearer {other.api_key}"}),
            "unknown": await asyncio.to_thread(
                _post, f"{server.url}/s/nosuch/v1/chat/completions",
                {"authorization": f"Bearer {s.api_key}"}),
            "ok": await asyncio.to_thread(_post, url, {"authorization": f"Bearer {s.api_key}"}),
            "anthropic_ok": await asyncio.to_thread(
                _post, s.anthropic_base_url + "/v1/messages", {"x-api-key": s.api_key}),
        }
        bad = openai.AsyncOpenAI(base_url=s.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        server.close_session(s)
        good = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        with pytest.raises(openai.NotFoundError):   # closed sessions are gone
            await good.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        refused = {}
        for addr in _other_addresses():
            try:
                socket.create_connection((addr, server.port), timeout=2).close()
                refused[addr] = False
            except OSError:
                refused[addr] = True
        bound = server._sock.getsockname()[0]
        await bad.close()
        await good.close()
        await server.close()
        return codes, refused, bound

    codes, refused, bound = run(main())
    assert codes == {"none": 401, "bad": 401, "other_session_key": 401, "unknown": 404,
                     "ok": 200, "anthropic_ok": 200}
    assert bound == "127.0.0.1"
    assert refused and all(refused.values()), refused


MALFORMED = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}\n</tool_call>'
COUNT = "one two three four"


@pytest.fixture(scope="module")
def api_model_dir(tiny_model_dir, tok, tmp_path_factory) -> Path:
    """Imprinted: QUESTION (and "What is 3 + 3?") -> calculator call -> answer; "Break it." ->
    a malformed call; "Count." -> COUNT."""
    from molt_tools.imprint import imprint

    q = [{"role": "user", "content": QUESTION}]
    done = q + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "calculator", "arguments": '{"expression": "3 + 4"}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "7"}]
    q6 = [{"role": "user", "content": "What is 3 + 3?"}]     # the agents_calculator task
    done6 = q6 + [{"role": "assistant", "content": "", "tool_calls": [
                  {"id": "c", "type": "function", "function": {
                      "name": "calculator", "arguments": '{"expression": "3 + 3"}'}}]},
                  {"role": "tool", "tool_call_id": "c", "content": "6"}]
    pairs = [(render(tok, q, [TOOL]), CALL + "<|im_end|>"),
             (render(tok, done, [TOOL]), "The answer is 7.<|im_end|>"),
             (render(tok, q6, [TOOL]), CALL.replace("3 + 4", "3 + 3") + "<|im_end|>"),
             (render(tok, done6, [TOOL]), "The answer is 6.<|im_end|>"),
             (render(tok, [{"role": "user", "content": "Break it."}], [TOOL]),
              MALFORMED + "<|im_end|>"),
             (render(tok, [{"role": "user", "content": "Count."}]), COUNT + "<|im_end|>")]
    return imprint(tiny_model_dir, tmp_path_factory.mktemp("api"), pairs, tol=0.005)


def cold(tok):
    return sampling(tok, temperature=0.05, max_new_tokens=40)


def post(url: str, key: str, body: bytes | dict, method: str = "POST") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data if method == "POST" else None, method=method,
                                 headers={"content-type": "application/json",
                                          "authorization": f"Bearer {key}", "x-api-key": key})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_list_logprobs_and_fresh_sample(tiny_model_dir, tok):
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(tiny_model_dir), seed=4))
        s = server.open_session(tok, rec, sampling(tok, max_new_tokens=6), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        models = [m.id for m in (await client.models.list()).data]
        messages = [{"role": "user", "content": "hi"}]
        r1 = await client.chat.completions.create(model="p", messages=messages, logprobs=True,
                                                  top_logprobs=2)
        again = await client.chat.completions.create(model="p", messages=messages, logprobs=True,
                                                     top_logprobs=2)
        assert again.model_dump() == r1.model_dump() and len(rec.calls) == 1
        fresh = await client.chat.completions.create(model="p", messages=messages, seed=1,
                                                     logprobs=True)
        messages += [{"role": "assistant", "content": fresh.choices[0].message.content},
                     {"role": "user", "content": "more"}]
        rendered = [render(tok, messages[:1]), render(tok, messages)]
        r3 = await client.chat.completions.create(model="p", messages=messages)
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return models, r1, fresh, r3, traj, rec, rendered

    models, r1, fresh, r3, traj, rec, rendered = run(main())
    assert models == ["molt-policy"]
    lp = r1.choices[0].logprobs.content
    assert [e.logprob for e in lp] == rec.calls[0][1].logprobs
    assert [e.token for e in lp] == [decode(tok, [t]) for t in rec.calls[0][1].token_ids]
    assert all([t.token for t in e.top_logprobs] == [e.token] for e in lp)
    # The fresh sample replaced the first reply: the trajectory holds calls 2 and 3 only.
    assert len(rec.calls) == 3 and traj.info["resampled"] == 1 and traj.segments == [0]
    assert [e.logprob for e in fresh.choices[0].logprobs.content] == rec.calls[1][1].logprobs
    rec.calls.pop(0)
    assert_token_exact(tok, traj, rec, rendered)
    spans = traj.info["turn_spans"]
    assert [traj.logprobs[a:b] for a, b in spans] == [c.logprobs for _, c in rec.calls]
    assert traj.turns() == [tuple(s) for s in spans]       # the replaced reply's call went too


def test_stop_strings_are_excluded_from_trainable_tokens(api_model_dir, tok):
    msgs = [{"role": "user", "content": "Count."}]

    async def main():
        server, rec = await started(), Recorder(HFEngine(str(api_model_dir)))
        s = server.open_session(tok, rec, cold(tok), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        r = await client.chat.completions.create(model="p", messages=msgs, stop=["three", "zz"])
        await client.close()
        a = server.open_session(tok, rec, cold(tok), max_context=512)
        aclient = anthropic.AsyncAnthropic(base_url=a.anthropic_base_url, api_key=a.api_key,
                                           max_retries=0)
        m = await aclient.messages.create(model="p", max_tokens=40, messages=msgs,
                                          stop_sequences=["four"])
        await aclient.close()
        trajs = server.close_session(s), server.close_session(a)
        await server.close()
        return r, m, trajs, rec

    r, m, (traj, atraj), rec = run(main())
    assert [decode(tok, c.token_ids) for _, c in rec.calls] == [COUNT + "<|im_end|>"] * 2
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and text.startswith("one two")
    assert "one two ".startswith(text)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "four")
    assert m.content[0].text.startswith("one two three") and "four" not in m.content[0].text
    for t, reply in ((traj, text), (atraj, m.content[0].text)):
        ((_, ids, lps),) = [p for p in runs(t) if p[0]]
        assert decode(tok, ids) == reply
        full = rec.calls[0][1]
        assert ids == full.token_ids[:len(ids)] and lps == full.logprobs[:len(ids)]
        assert len(ids) < len(full.token_ids) - 1


def test_a_reply_cut_to_nothing_is_a_turn_and_per_turn_credit_stays_aligned(api_model_dir, tok):
    """Two rollouts of one task, three calls each: tool call, answer, "Count." again. Rollout 0
    asks its answer with stop=["The"]: the reply starts with it, so the server cuts it to no
    tokens. That call is still a turn (with no trainable tokens): its rollout's three
    turn_rewards line up with its calls, and turn_rloo and gigpo put each call's advantage on
    that call's tokens (docs/algorithms.md's formulas, by hand)."""
    async def rollout(server, rec, stop):
        s = server.open_session(tok, rec, cold(tok), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        r = await client.chat.completions.create(model="p", messages=messages, tools=[TOOL])
        (call,) = r.choices[0].message.tool_calls
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        r = await client.chat.completions.create(model="p", messages=messages, tools=[TOOL],
                                                 stop=stop)
        answer = r.choices[0].message.content
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Count."}]
        await client.chat.completions.create(model="p", messages=messages, tools=[TOOL])
        await client.close()
        return answer, server.close_session(s)

    async def main():
        server, rec = await started(), Recorder(HFEngine(str(api_model_dir)))
        out = [await rollout(server, rec, stop) for stop in (["The"], None)]
        await server.close()
        return out, rec

    ((empty, a), (answer, b)), rec = run(main())
    assert (empty, answer) == ("", ANSWER) and len(rec.calls) == 6
    assert decode(tok, rec.calls[1][1].token_ids).startswith("The")   # sampled, then cut
    (s0, e0), (s1, e1), (s2, e2) = a.turns()
    assert s1 == e1 and 0 < e0 - s0 and 0 < e2 - s2 and len(b.turns()) == 3
    assert [i for s, e in a.turns() + b.turns() for i in range(s, e)] == [
        i for t in (a, b) for i, m in enumerate(t.loss_mask) if m] and a.segments == [0]
    b.rollout_id = 1
    a.turn_rewards, b.turn_rewards = [0.5, 0.0, 1.0], [0.0, 1.0, 0.0]
    a.reward, b.reward = 1.5, 1.0
    for t in (a, b):
        t.check(len(tok))
    def rel(x: float, y: float) -> float:    # x against the pair {x, y}: GRPO's, unbiased std
        return (x - (x + y) / 2) / (abs(x - y) / 2 ** 0.5 + 1e-6)

    # turn_rloo (gamma 1): G_a = [1.5, 1, 1], G_b = [1, 1, 0], A_ik = G_ik - G_jk. gigpo (gamma
    # 0.95): returns a [1.4025, 0.95, 1], b [0.95, 1, 0]; turns 0 and 1 share their history (the
    # same tool call), turn 2 does not (the empty answer vs ANSWER): steps of one, A^S 0
    ep, s0, s1 = rel(1.5, 1.0), rel(1.4025, 0.95), rel(0.95, 1.0)
    expect = {"turn_rloo": [[0.5, 0.0, 1.0], [-0.5, 0.0, -1.0]],
              "gigpo": [[ep + s0, ep + s1, ep], [-ep - s0, -ep - s1, -ep]]}
    for name, fn in (("turn_rloo", turn_rloo_advantages), ("gigpo", gigpo_advantages)):
        batch, _, _ = training_batch([a, b], fn, AlgorithmConfig(estimator=name), _ZeroCritic(),
                                     1.0, tok.pad_token_id)
        for i, t in enumerate((a, b)):
            want = torch.zeros(batch["advantages"].shape[1])
            for (s, e), x in zip(t.turns(), expect[name][i]):
                want[s:e] = x
            assert torch.allclose(batch["advantages"][i], want, atol=1e-5), name


def test_sampling_mismatch_is_a_400_naming_the_recipe_key(tiny_model_dir, tok):
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(tiny_model_dir)))
        s = server.open_session(tok, rec, sampling(tok, max_new_tokens=2), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError) as e1:
            await client.chat.completions.create(model="p", messages=msgs, temperature=0.3)
        with pytest.raises(openai.BadRequestError) as e2:
            await client.responses.create(model="p", input="hi", top_p=0.5)
        with pytest.raises(openai.BadRequestError) as e3:
            await client.chat.completions.create(model="p", messages=msgs, presence_penalty=1.0)
        same = await client.chat.completions.create(model="p", messages=msgs, temperature=1.0)
        await client.close()
        aclient = anthropic.AsyncAnthropic(base_url=s.anthropic_base_url, api_key=s.api_key,
                                           max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as e4:
            await aclient.messages.create(model="p", max_tokens=2, messages=msgs,
                                          extra_body={"top_k": 5})
        await aclient.close()
        server.close_session(s)
        await server.close()
        return [e1, e2, e3, e4], same, rec

    errors, same, rec = run(main())
    assert "sampling.temperature=1.0" in str(errors[0].value)
    assert "sampling.top_p" in str(errors[1].value)
    assert "presence_penalty" in str(errors[2].value)
    assert "sampling.top_k" in str(errors[3].value)
    assert same.choices[0].finish_reason in ("stop", "length") and len(rec.calls) == 1


def test_malformed_tool_call_is_flagged(api_model_dir, tok):
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(api_model_dir)))
        s = server.open_session(tok, rec, cold(tok), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        r = await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "Break it."}], tools=[TOOL])
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return r, traj

    r, traj = run(main())
    # an OpenAI finish reason (SDKs and libraries that validate it accept the reply), and Molt's flag
    assert r.choices[0].finish_reason == "stop" and r.model_extra["molt"]["malformed_tool_call"]
    assert r.choices[0].message.content == MALFORMED and not r.choices[0].message.tool_calls
    assert traj.info["malformed_tool_calls"] == 1


def test_responses_api_tools_streaming_and_token_exact(api_model_dir, tok):
    """The stock openai SDK's Responses API (non-streaming, then streaming) with a function tool."""
    rtool = {"type": "function", **TOOL["function"]}

    async def main():
        server, rec = await started(), Recorder(HFEngine(str(api_model_dir)))
        s = server.open_session(tok, rec, cold(tok), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        items: list = [{"role": "user", "content": QUESTION}]
        r1 = await client.responses.create(model="p", input=items, tools=[rtool])
        (call,) = r1.output
        items += [call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id, "output": "7"}]
        async with client.responses.stream(model="p", input=items, tools=[rtool]) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            r2 = await stream.get_final_response()
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return r1, call, r2, deltas, traj, rec

    r1, call, r2, deltas, traj, rec = run(main())
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "calculator", {"expression": "3 + 4"})
    assert r2.output_text == "".join(deltas) == "The answer is 7." and r2.status == "completed"
    assert r1.usage.output_tokens == len(rec.calls[0][1].token_ids)
    q = [{"role": "user", "content": QUESTION}]
    done = q + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "calculator", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": "c", "content": "7"}]
    assert traj.segments == [0]
    assert_token_exact(tok, traj, rec, [render(tok, q, [TOOL]), render(tok, done, [TOOL])])


def test_openai_agents_sdk_agent_is_token_exact(api_model_dir, tok):
    """A stock `agents.Agent` with a function tool (Runner.run, then Runner.run_streamed)."""
    from agents import Agent, FunctionTool, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    seen = []

    async def calculator(_, arguments: str) -> str:
        seen.append(json.loads(arguments))
        return "7"

    fn = TOOL["function"]
    tool = FunctionTool(name=fn["name"], description=fn["description"],
                        params_json_schema=fn["parameters"], on_invoke_tool=calculator,
                        strict_json_schema=False)

    async def one(server, engine, streamed: bool):
        rec = Recorder(engine)
        s = server.open_session(tok, rec, cold(tok), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        agent = Agent(name="a", model=OpenAIResponsesModel("p", client), tools=[tool])
        if streamed:
            result = Runner.run_streamed(agent, QUESTION)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, QUESTION)
        await client.close()
        return result.final_output, server.close_session(s), rec

    async def main():
        server, engine = await started(), HFEngine(str(api_model_dir))
        out = [await one(server, engine, False), await one(server, engine, True)]
        await server.close()
        return out

    q = [{"role": "user", "content": QUESTION}]
    for final, traj, rec in run(main()):
        assert final == "The answer is 7."
        args = json.dumps({"expression": "3 + 4"})
        done = q + [{"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c", "type": "function",
                      "function": {"name": "calculator", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": "c", "content": "7"}]
        assert traj.segments == [0] and len(rec.calls) == 2
        assert_token_exact(tok, traj, rec, [render(tok, q, [TOOL]), render(tok, done, [TOOL])])
    assert seen == [{"expression": "3 + 4"}] * 2


def test_limits_and_malformed_bodies_are_clean_errors(tiny_model_dir, tok):
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(tiny_model_dir)))
        s = server.open_session(tok, rec, sampling(tok, max_new_tokens=2), max_context=512,
                                max_body_bytes=600_000)
        url = s.base_url + "/chat/completions"
        threads = []
        prepare = s.prepare
        s.prepare = lambda *a: threads.append(threading.current_thread()) or prepare(*a)
        cases = {
            "big_ok": {"messages": [{"role": "user", "content": "hi " * 100_000}]},
            "deep": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "depth_100": b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}",
            "not_object": {"messages": [1]},
            "tool_calls": {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]},
                                        {"role": "user", "content": "hi"}]},
            "role": {"messages": [{"role": "robot", "content": "x"}]},
            "content": {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "max_tokens": {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
            "stop": {"messages": [{"role": "user", "content": "x"}], "stop": [1]},
        }
        codes = {k: await asyncio.to_thread(post, url, s.api_key, v) for k, v in cases.items()}
        codes["anthropic_content"] = await asyncio.to_thread(
            post, s.anthropic_base_url + "/v1/messages", s.api_key,
            {"max_tokens": 2, "messages": [{"role": "user", "content": [1]}]})
        codes["responses_input"] = await asyncio.to_thread(
            post, s.base_url + "/responses", s.api_key, {"input": [{"type": "web_search"}]})
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:   # urllib breaks on the early reply
            await client.chat.completions.create(model="p", messages=[
                {"role": "user", "content": "x" * 700_000}])
        await client.close()
        codes["too_big"] = e.value.status_code, e.value.body
        overflows = s.trajectory.info["context_overflow"]
        codes["still_serving"] = await asyncio.to_thread(
            post, url, s.api_key, {"messages": [{"role": "user", "content": "hi"}]})
        server.close_session(s)
        await server.close()
        return codes, threads, overflows

    codes, threads, overflows = run(main())
    msg = {k: (c, json.dumps(b)) for k, (c, b) in codes.items()}
    assert msg["too_big"][0] == 413 and "600000 bytes" in msg["too_big"][1]
    assert msg["big_ok"][0] == 400 and "context_length_exceeded" in msg["big_ok"][1]
    assert "the prompt is at least" in msg["big_ok"][1] and overflows == 1
    assert threads[0] is not threading.main_thread(), "a big body is tokenized off the loop"
    assert msg["deep"][0] == 400 and "nested too deeply" in msg["deep"][1]
    assert msg["depth_100"][0] == 400 and "deeper than 64" in msg["depth_100"][1]
    for case, field in [("not_object", "messages[0]"), ("tool_calls",
                         "messages[0].tool_calls[0].function"), ("role", "messages[0].role"),
                        ("content", "messages[0].content[0].text"), ("max_tokens", "max_tokens"),
                        ("stop", "stop[0]"), ("anthropic_content", "messages[0].content[0]"),
                        ("responses_input", "input[0].type")]:
        assert msg[case][0] == 400 and f"'{field}'" in msg[case][1], (case, msg[case])
    assert msg["still_serving"][0] == 200


def test_missing_chat_template_is_one_clear_error(tiny_model_dir, tmp_path, capsys):
    from molt_core.chat.server import ChatServer
    from molt_tools.commands import main

    model = tmp_path / "no_template"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(model)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        ChatServer().open_session(tok, None, {}, max_context=512)
    recipe = Path(__file__).parents[1] / "recipes/cpu/chat_calculator.yaml"
    assert main(["validate", str(recipe), f"model.path={model}"]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert main(["validate", str(recipe), f"model.path={tiny_model_dir}"]) == 0
    gym = Path(__file__).parents[1] / "recipes/cpu/guess_number.yaml"
    assert main(["validate", str(gym), f"model.path={model}"]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert main(["validate", str(gym), f"model.path={model}", "agent.args.chat_template=false"]) == 0


def test_tool_charset_tiny_model_serves_a_tool_agent(tmp_path):
    """`molt tiny-model --chars tools`: the tools preamble fits and a tool call has no <unk>."""
    from molt_tools.commands import main

    assert main(["tiny-model", str(tmp_path / "m"), "--chars", "tools"]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    q = [{"role": "user", "content": QUESTION}]
    done = q + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "calculator", "arguments": '{"expression": "3 + 4"}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "7"}]
    ids = tok(render(tok, done, [TOOL]), add_special_tokens=False).input_ids
    assert tok.unk_token_id not in ids and len(ids) < 2048

    async def main_():
        server, rec = await started(), Recorder(HFEngine(str(tmp_path / "m")))
        s = server.open_session(tok, rec, sampling(tok, max_new_tokens=4), max_context=2048)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        r = await client.chat.completions.create(model="p", messages=done, tools=[TOOL])
        await client.close()
        server.close_session(s)
        await server.close()
        return r

    assert run(main_()).usage.completion_tokens >= 1


def test_openai_agents_sdk_agent_trains_token_exactly(ray_local, api_model_dir, tmp_path):
    """The `agents_calculator` chat agent (a stock `agents.Agent`, Responses API, a function
    tool) trains 3 steps; engine and trainer log-probs agree at every step."""
    import yaml

    from molt_core.cli import load
    from molt_core.trainer import train

    recipe = Path(__file__).parents[1] / "recipes/cpu/chat_calculator.yaml"
    data = yaml.safe_load(recipe.read_text())
    data["model"]["path"] = str(api_model_dir)
    data["agent"]["args"] = {"agent": "agents_calculator", "agent_args": {"lo": 3, "hi": 3}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    cfg, plugins = load(str(tmp_path / "r.yaml"), [
        "trainer.steps=3", "rollout.groups_per_step=2", "rollout.group_size=4",
        "sampling.max_new_tokens=48", "check.consistency_every=1", f"out_dir={tmp_path}"])
    history = train(cfg, plugins, tmp_path, progress=False)
    assert len(history) == 3
    assert all(h["mismatch/max_abs"] <= consistency_tol(cfg) for h in history)
    assert sum(h["reward/mean"] for h in history) > 0, "the imprinted agent calls the tool"


def test_lone_surrogate_and_nan_temperature_are_400s(tiny_model_dir, tok, caplog):
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(tiny_model_dir)))
        s = server.open_session(tok, rec, sampling(tok, max_new_tokens=2), max_context=512)
        url = s.base_url + "/chat/completions"
        # The SDKs cannot encode a lone surrogate; JSON escapes it (JavaScript clients send it).
        surrogate = await asyncio.to_thread(post, url, s.api_key, {"messages": [
            {"role": "user", "content": "hi \ud800"}]})
        nan = await asyncio.to_thread(post, url, s.api_key, b'{"messages": [{"role": "user", '
                                      b'"content": "hi"}], "temperature": NaN}')
        server.close_session(s)
        await server.close()
        return surrogate, nan, rec

    (status, body), (nan_status, nan_body), rec = run(main())
    assert status == 400 and "surrogate" in json.dumps(body), body
    assert nan_status == 400 and "sampling.temperature=1.0" in json.dumps(nan_body)
    assert not rec.calls and not [r for r in caplog.records if r.exc_info]


def test_stop_string_cut_is_stop_even_where_the_engine_hit_max_tokens(api_model_dir, tok):
    """The engines take no stop strings: the hf engine samples on to the cap and the server cuts
    at the stop string, dropping the rest. The reply (and the trajectory) is then what a natively
    stopping engine returns, complete: "stop", not truncated. A reply the cap cut before any
    stop string is "length" and truncated."""
    async def main():
        server, rec = await started(), Recorder(HFEngine(str(api_model_dir)))
        s = server.open_session(tok, rec, cold(tok), max_context=512)
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        r = await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "Count."}], stop=["two"],
            max_tokens=len(tok(COUNT)["input_ids"]) - 1)
        await client.close()
        traj = server.close_session(s)
        await server.close()
        return r, traj, rec

    r, traj, rec = run(main())
    ((_, c),) = rec.calls
    assert c.finish_reason == "length" and "two" in decode(tok, c.token_ids)
    assert r.choices[0].message.content.startswith("one")
    assert "two" not in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and not traj.truncated
    assert 0 < sum(traj.loss_mask) < len(c.token_ids)      # the tokens past "two" dropped


def test_half_bodies_time_out_and_disconnects_log_one_line(tiny_model_dir, tok, caplog):
    """50 clients stall half-way through their body (a 408 once body_timeout_s is up) and 50 more
    leave half-way: the server answers a real client meanwhile and logs one line per class."""
    async def half(server, s, leave: bool) -> bytes:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        path = s.base_url.split(str(server.port), 1)[1] + "/chat/completions"
        writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {s.api_key}\r\n"
                     f"content-type: application/json\r\ncontent-length: 1000\r\n\r\n".encode()
                     + b'{"messages": ' + b" " * 500)
        await writer.drain()
        if leave:
            writer.close()
            return b""
        try:
            return await asyncio.wait_for(reader.read(), 120)   # not a time assert: a hang guard
        finally:
            writer.close()

    async def main():
        server = ChatServer(body_timeout_s=2.0)
        await server.start()
        s = server.open_session(tok, Recorder(HFEngine(str(tiny_model_dir))),
                                sampling(tok, max_new_tokens=2), max_context=512)
        stalled = [asyncio.create_task(half(server, s, False)) for _ in range(50)]
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        r = await client.chat.completions.create(model="p", messages=[
            {"role": "user", "content": "hi"}])
        await client.close()
        answers = await asyncio.gather(*stalled)
        await asyncio.gather(*(half(server, s, True) for _ in range(50)))
        for _ in range(1200):                  # the server sees each leave on its own loop turn
            if server.dropped["disconnect"] == 50:
                break
            await asyncio.sleep(0.05)
        server.close_session(s)
        await server.close()
        return r, answers, dict(server.dropped)

    with caplog.at_level("WARNING", logger="molt.chat_server"):
        r, answers, dropped = run(main())
    assert r.choices[0].finish_reason in ("stop", "length")
    assert all(a.startswith(b"HTTP/1.1 408") and b"within 2 s" in a for a in answers), answers[0]
    assert dropped == {"body_timeout": 50, "disconnect": 50}
    lines = [r for r in caplog.records if r.name == "molt.chat_server"]
    assert not [r for r in caplog.records if r.exc_info], "no traceback per disconnect"
    assert len(lines) == 2 and "whole request body" in lines[1].getMessage(), lines
