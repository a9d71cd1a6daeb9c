"""Env `dataset` (issue 27): local files, splits, epochs by the run's seed, and reward functions
as plain callables in TRL's and Molt's forms, including bad ones."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet
import pytest

from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.rollout.eval import EVAL_TASKS
from molt_core.rollout.generator import Generator
from molt_gym import Dataset

ROWS = [{"prompt": f"after {c}", "answer": chr(ord(c) + 1)} for c in "abcdefghij"]

# TRL's reward functions as its documentation writes them (GRPOTrainer, "Using a custom reward
# function"), plus an async one and Molt's per-rollout form
REWARDS = '''
import re

def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]

async def exact(completions, answer, prompts, **kwargs):
    return [float(c.strip() == a) if p != "after j" else None
            for c, a, p in zip(completions, answer, prompts)]

def first_letter(completion, answer):
    return float(completion.strip()[:1] == answer), {"first": completion[:1]}

def broken(completion, answer):
    return {"a": 1}[answer]

def as_text(completion, answer):
    return "0.5"

def two_values(completions, **kwargs):
    return [1.0, 2.0]

def nan_for_b(completion, answer):
    return math.nan if answer == "b" else 1.0

import math
'''


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    yield tmp_path
    import sys
    sys.modules.pop("my_rewards", None)


def run(coro):
    return asyncio.run(coro)


def test_files_splits_and_epochs(data):
    table = pa.Table.from_pylist(ROWS)
    pyarrow.parquet.write_table(table, data / "rows.parquet")
    pyarrow.csv.write_csv(table, data / "rows.csv")
    env = {f: Dataset(data=f"rows.{f}", reward="my_rewards:first_letter", test_fraction=0.0)
           for f in ("jsonl", "parquet", "csv")}
    assert env["jsonl"].rows == env["parquet"].rows == env["csv"].rows == tuple(ROWS)
    # training walks the rows in epochs, each a permutation drawn from the run's seed
    gen = SimpleNamespace(cfg=SimpleNamespace(seed=3))

    def order(env: Dataset, seed: int, groups: int) -> list[int]:
        gen.cfg.seed = seed
        return [(run(env.reset(Generator.task_of(gen, g))), env.index)[1] for g in range(groups)]
    first = order(env["jsonl"], 3, 30)
    epochs = [first[i:i + 10] for i in range(0, 30, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs) and len(set(map(tuple, epochs))) == 3
    assert order(env["jsonl"], 3, 30) == first != order(env["jsonl"], 4, 30)
    in_order = Dataset(data="rows.jsonl", reward="my_rewards:first_letter", test_fraction=0.0,
                       shuffle=False)
    assert order(in_order, 3, 12) == [*range(10), 0, 1]
    # splits: a hash of the prompt, a "split" column, or {split: file}; never overlapping
    train, test = (Dataset(data="rows.jsonl", reward="my_rewards:exact", split=s,
                           test_fraction=0.3) for s in ("train", "test"))
    assert len(train.rows) + len(test.rows) == 10 and not set(map(str, train.rows)) & set(
        map(str, test.rows))
    held = {run(test.reset(EVAL_TASKS + i)) for i in range(len(test.rows))}
    assert held == {r["prompt"] for r in test.rows}       # eval sees every held-out row once
    (data / "declared.jsonl").write_text(json.dumps({**ROWS[0], "split": "test"}) + "\n" +
                                         json.dumps(ROWS[1]) + "\n")
    assert Dataset(data="declared.jsonl", reward="my_rewards:exact", split="test",
                   test_fraction=0.0).rows == ({**ROWS[0], "split": "test"},)
    # info: a row's index in its split (`row`) and its line in the file, blank lines counted
    (data / "blank.jsonl").write_text("\n".join(["", json.dumps({**ROWS[0], "split": "test"}),
                                                    "", json.dumps(ROWS[1])]) + "\n")
    train = Dataset(data="blank.jsonl", reward="my_rewards:exact", test_fraction=0.0)
    run(train.reset(0))
    assert train.lines == (4,) and run(train.step("c"))[3] == {
        "row": 0, "line": 4, "columns": {"answer": "c"}, "reward/my_rewards:exact": 1.0}
    with pytest.raises(ValueError, match="'question'.*row 0 lacks"):
        Dataset(data="rows.jsonl", reward="my_rewards:exact", prompt="question")


def test_datasets_directory(data):
    import datasets     # installed by `make test` (molt-adapter-verifiers needs it): no skip
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:6]),
                          "test": datasets.Dataset.from_list(ROWS[6:])}).save_to_disk("hf")
    assert [r["prompt"] for r in Dataset(data="hf", reward="my_rewards:exact",
                                         split="test").rows] == [r["prompt"] for r in ROWS[6:]]


def test_reward_functions_trl_and_molt_forms(data):
    """TRL's documented functions run unchanged (plain and chat-message prompts); weights sum;
    None is skipped; info and each function's value land in the trajectory's info."""
    env = Dataset(data="rows.jsonl", test_fraction=0.0, shuffle=False,
                  reward={"my_rewards:reward_len": 0.5, "my_rewards:exact": 2.0,
                          "./my_rewards.py:first_letter": 1.0})
    assert run(env.reset(1)) == "after b"
    _, reward, done, info = run(env.step(" c"))
    assert done and reward == 0.5 * -18 + 2.0 * 1.0 + 1.0
    assert info == {"row": 1, "line": 2, "columns": {"answer": "c"},
                    "reward/my_rewards:reward_len": -18.0, "first": " ",
                    "reward/my_rewards:exact": 1.0, "reward/./my_rewards.py:first_letter": 1.0}
    run(env.reset(9))                                           # exact: None for "after j"
    assert run(env.step("k"))[1] == 0.5 * -19 + 1.0
    (data / "chat.jsonl").write_text(json.dumps(
        {"prompt": [{"role": "user", "content": "think, then answer"}], "answer": "x"}) + "\n")
    chat = Dataset(data="chat.jsonl", test_fraction=0.0, reward=["my_rewards:format_reward_func"])
    assert run(chat.reset(0)) == [{"role": "user", "content": "think, then answer"}]
    assert run(chat.step("<think>hm</think><answer>x</answer>"))[1] == 1.0
    assert run(chat.step("x"))[1] == 0.0


def test_bad_reward_functions_name_themselves_and_the_row(data, tiny_chars_dir):
    env = Dataset(data="rows.jsonl", test_fraction=0.0, shuffle=False,
                  reward="my_rewards:broken")
    run(env.reset(2))
    with pytest.raises(RuntimeError, match=r"'my_rewards:broken' failed on row 2 \('after c'\): "
                                           "KeyError: 'd'"):
        run(env.step("d"))
    env = Dataset(data="rows.jsonl", test_fraction=0.0, reward="my_rewards:two_values")
    run(env.reset(0))
    with pytest.raises(RuntimeError, match="two_values.*returned \\[1.0, 2.0\\]; expected a list "
                                           "of one float"):
        run(env.step("x"))
    env = Dataset(data="rows.jsonl", test_fraction=0.0, reward="my_rewards:as_text")
    run(env.reset(0))                     # float("0.5") scored a string as 0.5 (issue 41.11)
    with pytest.raises(RuntimeError, match="as_text.*reward '0.5' is a str, not a number"):
        run(env.step("x"))
    env = Dataset(data="rows.jsonl", test_fraction=0.0, shuffle=False, reward="my_rewards:exact")
    run(env.reset(9))                                   # every function None: NaN, dropped
    assert math.isnan(run(env.step("k"))[1])
    base = [f"model.path={tiny_chars_dir}", "agent.args.env=dataset"]
    for reward, says in (("my_rewards:nope", "has no attribute 'nope'"),
                         ("missing_mod:fn", "No module named 'missing_mod'"),
                         ("nope", r"'nope' \(module:function\)")):
        with pytest.raises(ConfigError, match=says):
            load(None, [*base, f"agent.args.env_args={{data: rows.jsonl, reward: '{reward}'}}"])
    with pytest.raises(ConfigError, match="No such file.*missing.jsonl"):
        load(None, [*base, "agent.args.env_args={data: missing.jsonl, reward: my_rewards:exact}"])
    assert math.isnan(run(_nan_step(Dataset(data="rows.jsonl", test_fraction=0.0, shuffle=False,
                                            reward="my_rewards:nan_for_b"))))


async def _nan_step(env: Dataset) -> float:
    await env.reset(0)
    return (await env.step("b"))[1]


def test_bad_rows_name_the_file_and_line(data):
    """A broken JSONL line and a prompt that is neither text nor chat messages are one error
    naming the file and line (issue 41.11: a JSONDecodeError without them; a wrong-type prompt
    passed validate and ended the run in a 50-line traceback)."""
    Path("broken.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b", \n')
    with pytest.raises(ValueError, match=r"^broken.jsonl:3: not valid JSON \(Expecting"):
        Dataset(data="broken.jsonl", reward="my_rewards:exact", test_fraction=0.0)
    Path("listed.jsonl").write_text('["prompt", "a"]\n')
    with pytest.raises(ValueError, match=r"^listed.jsonl:1: a JSON list, not an object"):
        Dataset(data="listed.jsonl", reward="my_rewards:exact", test_fraction=0.0)
    Path("typed.jsonl").write_text('{"prompt": "a"}\n{"prompt": 5}\n')
    with pytest.raises(ValueError, match=r"^typed.jsonl: row 2's 'prompt' is int 5; it must be "
                                         "text or a list of chat messages"):
        Dataset(data="typed.jsonl", reward="my_rewards:exact", test_fraction=0.0)
