"""`molt rollout` as a demonstration source (molt_tools.demos): a scripted oracle, a teacher URL,
the keep filter, SFT rows as the chat server saw them, base rates."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import yaml

from molt_tools.agent_dev import serve
from molt_tools.commands import main, parse

ROOT = Path(__file__).parents[1]


def _recipe(tmp_path: Path, model: Path) -> str:
    data = yaml.safe_load(open(ROOT / "recipes/cpu/chat_calculator.yaml"))
    data["model"]["path"] = str(model)
    data["sampling"]["max_new_tokens"] = 8
    path = tmp_path / "calc.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_scripted_oracle_demos_become_chat_sft_rows(tiny_model_dir, tmp_path, capsys):
    recipe, out = _recipe(tmp_path, tiny_model_dir), tmp_path / "demos.jsonl"
    assert main(["rollout", recipe, "-n", "3", "--policy", "scripted", "--keep", "reward>=1",
                 "--sft-out", str(out), "--quiet", f"out_dir={tmp_path / 'runs'}"]) == 0
    printed = capsys.readouterr().out
    assert "base rate: mean reward 1.000, success 1.000 (reward >= 1), tool-call rate 1.000" \
        in printed and "kept 3 of 3" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        user, call, result, answer = r["messages"]
        assert user["role"] == "user" and r["tools"][0]["function"]["name"] == "calculator"
        (tc,) = call["tool_calls"]
        expr = json.loads(tc["function"]["arguments"])["expression"]
        assert user["content"] == f"What is {expr}?" and result == {
            "role": "tool", "tool_call_id": tc["id"], "content": str(eval(expr))}
        assert answer == {"role": "assistant", "content": str(eval(expr))}


def test_keep_drops_failures_and_the_model_policy_reports_base_rates(tiny_model_dir, tmp_path,
                                                                     capsys):
    """The random tiny model never solves it: nothing is kept; its tool-call rate is printed."""
    recipe, out = _recipe(tmp_path, tiny_model_dir), tmp_path / "demos.jsonl"
    assert main(["rollout", recipe, "-n", "2", "--keep", "reward>=1", "--sft-out", str(out),
                 "--quiet", f"out_dir={tmp_path / 'runs'}"]) == 0
    printed = capsys.readouterr().out
    assert "success 0.000 (reward >= 1), tool-call rate 0.000" in printed
    assert "kept 0 of 2" in printed and out.read_text() == ""
    assert main(["rollout", recipe, "--keep", "reward=>1"]) == 2


def test_teacher_url_answers_through_the_chat_server(tiny_model_dir, tmp_path, monkeypatch,
                                                     capsys):
    """The teacher is `molt serve` of the tiny model (a real OpenAI-compatible server): every
    reply the agent got is the teacher's, and the rows hold the conversations it answered."""
    recipe = _recipe(tmp_path, tiny_model_dir)
    got: dict = {}
    ready, stop, result = threading.Event(), threading.Event(), []
    t = threading.Thread(target=lambda: result.append(serve(
        parse(["serve", recipe, f"out_dir={tmp_path / 'teacher'}"]),
        lambda info: (got.update(info), ready.set()), stop)))
    t.start()
    try:
        assert ready.wait(300), "the teacher did not come up"
        monkeypatch.setenv("MOLT_TEACHER_API_KEY", got["api_key"])
        out = tmp_path / "demos.jsonl"
        assert main(["rollout", recipe, "-n", "2", "--teacher-url", got["openai_base_url"],
                     "--sft-out", str(out), "--quiet", f"out_dir={tmp_path / 'runs'}"]) == 0
    finally:
        stop.set()
        t.join(120)
    assert result == [0]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["messages"][0]["content"].startswith("What is")
                                  and r["messages"][-1]["role"] == "assistant" for r in rows)
    from molt_tools.view import read_trajectories
    (teacher,) = read_trajectories(got["run_dir"])    # it sampled every reply the rows hold
    assert sum(1 for r in rows for m in r["messages"] if m["role"] == "assistant") == \
        len(json.loads(teacher["info"])["turn_spans"])


def test_a_gym_agent_gives_prompt_completion_rows(tiny_recipe, tmp_path, capsys):
    """Not a chat agent: one row per model call, the text before it and the call as sampled."""
    out = tmp_path / "demos.jsonl"
    assert main(["rollout", tiny_recipe, "-n", "2", "--sft-out", str(out), "--quiet",
                 f"out_dir={tmp_path / 'runs'}"]) == 0
    from molt_tools.view import read_trajectories
    (run_dir,) = (tmp_path / "runs").iterdir()
    saved = read_trajectories(run_dir)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] + r["completion"] for r in rows] == [s["segment_text"][0] for s in saved]
    assert "tool-call rate" not in capsys.readouterr().out
    assert main(["rollout", tiny_recipe, "--policy", "scripted"]) == 2
