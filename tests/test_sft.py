"""`molt sft` (molt_core.sft_trainer): rows rendered as the real chat server records them (real
uvicorn, the real openai SDK), bad rows named, and a real run on the tiny model that lowers the
held-out loss and leaves a model `molt run` starts from."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from molt_core.chat.server import ChatServer
from molt_core.cli import start as run_start
from molt_core.config import ConfigError
from molt_core.multimodal import load_tokenizer
from molt_core.sft_trainer import render_row, start
from molt_core.trajectory import Completion

TEMPLATE = str(Path(__file__).parents[1] / "recipes/templates/smollm2_tools.jinja")
TOOLS = [{"type": "function", "function": {
    "name": "convert", "description": "Convert a length between units",
    "parameters": {"type": "object", "properties": {"value": {"type": "number"},
                                                    "unit": {"type": "string"}}}}}]


def call(cid: str, value: float, unit: str) -> dict:
    return {"id": cid, "type": "function", "function": {
        "name": "convert", "arguments": json.dumps({"value": value, "unit": unit})}}


def transcript(n: int) -> dict:
    """Two tool rounds (two parallel calls in the first), then the answer."""
    return {"tools": TOOLS, "messages": [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": f"How many cm are {n} m and {n} km?"},
        {"role": "assistant", "content": "Converting.",
         "tool_calls": [call("a", n, "m"), call("b", n, "km")]},
        {"role": "tool", "tool_call_id": "a", "content": f"{n * 100} cm"},
        {"role": "tool", "tool_call_id": "b", "content": f"{n * 100000} cm"},
        {"role": "assistant", "content": "", "tool_calls": [call("c", n * 100100, "cm")]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
        {"role": "assistant", "content": f"{n * 100100} cm in all."}]}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir), TEMPLATE)


@pytest.mark.parametrize("scripted", [False, True])
def test_rows_are_token_for_token_what_the_chat_server_records(tok, scripted):
    """The server's policy samples SFT's targets, or (`scripted`: a teacher or oracle, `respond`)
    answers with the row's assistant messages, which the server renders as SFT does."""
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    for n in (3, 12):
        row = transcript(n)
        sft = render_row(row, tok, stop, 2048)
        replies = [sft.token_ids[a:b] for a, b in sft.calls]
        answers = iter(m for m in row["messages"] if m["role"] == "assistant")

        async def respond(messages: list[dict], tools: list[dict] | None) -> dict:
            return next(answers)

        async def generate(prompt_ids: list[int], sampling: dict) -> Completion:
            ids = replies[len(s.trajectory.calls)]       # the policy samples SFT's targets,
            ids = ids[:next((k + 1 for k, t in enumerate(ids) if t in stop), len(ids))]  # to a stop
            return Completion(ids, [-0.1] * len(ids), [0] * len(ids))

        async def main():
            nonlocal s
            server = ChatServer()
            await server.start()
            s = server.open_session(tok, generate, {"temperature": 1.0, "max_new_tokens": 200},
                                    max_context=2048, respond=respond if scripted else None)
            client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
            msgs, want = row["messages"][:2], iter(row["messages"][2:])
            for m in want:                  # an agent loop: the SDK's replies, the tool results
                r = (await client.chat.completions.create(model="p", messages=msgs,
                                                          tools=TOOLS)).choices[0].message
                got = [(c.function.name, json.loads(c.function.arguments))
                       for c in r.tool_calls or []]
                assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                               for c in m.get("tool_calls", [])]
                msgs.append(r.model_dump(exclude_none=True))
                for c in r.tool_calls or []:
                    msgs.append({**next(want), "tool_call_id": c.id})
            await client.close()
            traj = server.close_session(s)
            await server.close()
            return traj
        s = None
        traj = asyncio.run(main())
        assert traj.segments == sft.segments == [0]
        assert traj.token_ids == sft.token_ids and traj.loss_mask == sft.loss_mask
        assert sum(sft.loss_mask) > 0 and len(sft.calls) == 3


@pytest.mark.parametrize("messages, why", [
    ([{"role": "user", "content": "hi"}], "no assistant turn"),
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}],
     "unsupported message role 'robot'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                                         "tool_calls": [call("a", 1, "m")]}],
     "makes 1 tool calls but 0 tool results"),
    ([{"role": "user", "content": "hi " * 400}, {"role": "assistant", "content": "x"}],
     "context"),
])
def test_a_bad_row_is_an_error_naming_file_and_row(tiny_recipe, tmp_path, messages, why):
    data = tmp_path / "rows.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    data.write_text(json.dumps(good) + "\n\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ConfigError, match=rf"rows.jsonl row 3: .*{why}"):
        start(tiny_recipe, [f"sft.data={data}", f"model.chat_template={TEMPLATE}",
                            "sft.max_tokens=256"], progress=False)


def test_sft_lowers_the_held_out_loss_and_molt_run_starts_from_it(tiny_recipe, tmp_path):
    data = tmp_path / "demos.jsonl"
    rows = [transcript(n) for n in range(1, 25)] + [
        {"prompt": f"Say {n}.", "completion": f"{n}"} for n in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir, history = start(tiny_recipe, [
        f"sft.data={data}", f"model.chat_template={TEMPLATE}", "sft.steps=12", "sft.batch_size=8",
        "sft.eval_fraction=0.25", "trainer.lr=0.01", "trainer.micro_batch_size=4"],
        progress=False)
    evals = [h["eval/loss"] for h in history if "eval/loss" in h]
    steps = [h for h in history if "train/loss" in h]
    assert len(steps) == 12 and len(evals) == 2 and evals[-1] < 0.7 * evals[0]
    assert steps[-1]["train/loss"] < steps[0]["train/loss"]
    assert (run_dir / "metrics.jsonl").read_text().count("eval/loss") == 2
    _, rl = run_start(tiny_recipe, [f"model.path={run_dir / 'final'}", "trainer.steps=1",
                                    f"out_dir={tmp_path / 'rl'}"], progress=False)
    assert [h for h in rl if "reward/mean" in h]
