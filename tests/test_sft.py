"""`molt sft` (molt_core.sft_trainer): rows rendered as the real chat server records them (real
uvicorn, the real openai SDK), bad rows named, and a real run on the tiny model that lowers the
held-out loss and leaves a model `molt run` starts from."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pyarrow as pa
import pytest
import structlog
import torch
from pyarrow import csv, parquet
from safetensors.torch import load_file

from molt_core.chat.server import ChatServer
from molt_core.cli import start as run_start
from molt_core.config import ConfigError, load_config
from molt_core.multimodal import load_tokenizer
from molt_core.sft_trainer import load_data, render_row, start
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


def test_parquet_and_csv_rows_are_the_jsonl_rows(tiny_recipe, tok, tmp_path):
    """Tool transcripts as Parquet (pyarrow fills a message's missing keys with None) and
    prompt/completion rows as CSV (which reads the completion 7 as a number) train on the same
    tokens as the JSONL rows."""
    chats = [transcript(n) for n in (2, 5)]
    pairs = [{"prompt": f"Say {n}.", "completion": n} for n in (7, 8)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    (tmp_path / "pairs.jsonl").write_text("".join(
        json.dumps({**r, "completion": str(r["completion"])}) + "\n" for r in pairs))
    parquet.write_table(pa.Table.from_pylist(chats), tmp_path / "chats.parquet")
    csv.write_csv(pa.Table.from_pylist(pairs), tmp_path / "pairs.csv")
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]

    def rows(name: str) -> list[tuple[list[int], list[bool]]]:
        cfg = load_config(tiny_recipe, [f"sft.data={tmp_path / name}", "sft.eval_fraction=0"])
        return [(t.token_ids, t.loss_mask) for t in load_data(cfg, tok, stop, 2048)[0]]
    assert rows("chats.parquet") == rows("chats.jsonl") and len(rows("chats.jsonl")) == 2
    assert rows("pairs.csv") == rows("pairs.jsonl") and len(rows("pairs.jsonl")) == 2


def test_bad_rows_are_skipped_and_counted_where_the_recipe_says_so(tiny_recipe, tmp_path):
    data = tmp_path / "rows.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "no completion"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in [good, *bad, good, good]))
    with structlog.testing.capture_logs() as logs:
        _, history = start(tiny_recipe, [f"sft.data={data}", "sft.skip_bad_rows=true",
                                         f"model.chat_template={TEMPLATE}", "sft.steps=2",
                                         "sft.eval_fraction=0"], progress=False)
    warned = [e["event"] for e in logs if e["log_level"] == "warning" and "bad rows" in e["event"]]
    assert len(warned) == 1 and "skipped 2 bad rows" in warned[0] and "row 2: no assistant" in \
        warned[0]
    assert [h["sft/skipped_rows"] for h in history] == [2, 2]


def test_resume_is_bit_identical(tiny_recipe, tmp_path):
    """Stopped after a checkpoint (here: resumed from the middle one), the run redoes the same
    steps: same rows (the data cursor across an epoch, AdamW, the RNG) and final weights; rows'
    `step` as molt run's: train 1..N, eval/loss 0..N."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {n}.", "completion": f"{n} {n}"}) + "\n"
                            for n in range(10)))
    run_dir, first = start(tiny_recipe, [
        f"sft.data={data}", f"model.chat_template={TEMPLATE}", "sft.steps=4", "sft.batch_size=3",
        "sft.eval_fraction=0.2", "sft.eval_every=2", "trainer.save_every=2", "trainer.lr=0.01"],
        progress=False)

    def done() -> tuple[list[dict], dict]:
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
        timeless = [{k: v for k, v in r.items() if not (k.startswith(("time", "elapsed",
                     "memory")) or k.endswith("_s"))} for r in rows]
        return timeless, load_file(run_dir / "final/model.safetensors")
    (rows, weights), ckpt = done(), run_dir / "checkpoints/step_000002"
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 2, 4]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    _, again = start(None, [], resume=str(run_dir), checkpoint=str(ckpt), progress=False)
    assert len(again) == 4              # eval/loss after 2 (logged after the checkpoint), 3, 4
    rows2, weights2 = done()
    assert rows2 == rows and len(rows) == 7
    assert weights2.keys() == weights.keys() and all(torch.equal(weights2[k], weights[k])
                                                     for k in weights)


def test_a_recipe_with_no_agent_section_trains(tiny_model_dir, tmp_path):
    """`molt sft` needs no agent (it said "agent 'gym' needs env"); `molt run` on the same recipe
    still asks for one."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {n}.", "completion": f"{n}"}) + "\n"
                            for n in range(8)))
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"model: {{path: {tiny_model_dir}}}\nsft: {{data: {data}, steps: 1, "
                      f"batch_size: 4}}\nout_dir: {tmp_path / 'runs'}\n")
    run_dir, history = start(str(recipe), [], progress=False)
    assert len([h for h in history if "train/loss" in h]) == 1 and (run_dir / "final").is_dir()
    with pytest.raises(ConfigError, match="agent 'gym' .* needs env"):
        run_start(str(recipe), [], progress=False)
