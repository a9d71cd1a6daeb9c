"""`molt rollout` and `molt serve` (molt_tools.agent_dev): real Ray engines, no trainer."""

from __future__ import annotations

import threading

import openai

from molt_tools.commands import main
from molt_tools.agent_dev import serve
from molt_tools.commands import parse
from molt_core.rollout.eval import EVAL_TASKS
from molt_tools.view import read_trajectories


def test_rollout_saves_training_format_and_prints_rewards(ray_local, tiny_recipe, tmp_path,
                                                          capsys):
    out = tmp_path / "out"
    assert main(["rollout", tiny_recipe, "-n", "3", f"out_dir={out}"]) == 0
    printed = capsys.readouterr().out
    (run_dir,) = out.iterdir()
    rows = read_trajectories(run_dir)
    assert len(rows) == 3 and {r["step"] for r in rows} == {0}
    assert all(len(r["token_ids"]) == len(r["loss_mask"]) == len(r["behavior_logprobs"])
               and any(r["loss_mask"]) for r in rows)
    for i, r in enumerate(rows):
        assert f"rollout {i}: task {r['task']}, reward {r['reward']:.3f}" in printed
    assert printed.count("⟦") >= 3 and "mean reward" in printed


def test_serve_answers_sdks_and_saves_the_trajectory(ray_local, tiny_recipe, tmp_path, capsys):
    args = parse(["serve", tiny_recipe, f"out_dir={tmp_path}"])
    got: dict = {}
    ready, stop = threading.Event(), threading.Event()
    result: list[int] = []

    def on_ready(info: dict) -> None:
        got.update(info)
        ready.set()

    t = threading.Thread(target=lambda: result.append(serve(args, on_ready, stop)))
    t.start()
    try:
        assert ready.wait(300), "serve did not come up"
        client = openai.OpenAI(base_url=got["openai_base_url"], api_key=got["api_key"],
                               max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["molt-policy"]
        r = client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, logprobs=True)
        n = r.usage.completion_tokens
    finally:
        stop.set()
        t.join(120)
    assert result == [0]
    printed = capsys.readouterr().out       # what the developer copies into the agent
    for key in ("openai_base_url", "anthropic_base_url", "api_key"):
        assert got[key] in printed, key
    (row,) = read_trajectories(got["run_dir"])
    assert sum(row["loss_mask"]) == n
    assert row["behavior_logprobs"][-n:] == [e.logprob for e in r.choices[0].logprobs.content]


def test_rollout_greedy_on_held_out_tasks(ray_local, tiny_recipe, tmp_path):
    """`molt rollout --greedy --eval`: eval's greedy pass as a dry run (sampling.top_k=1 is
    refused for training: the trainer cannot reproduce it); twice, the same tokens."""
    runs = []
    for name in ("a", "b"):
        assert main(["rollout", tiny_recipe, "-n", "2", "--greedy", "--eval", "--quiet",
                     f"out_dir={tmp_path / name}", "agent.args.env=arithmetic",
                     "eval.agent_args={env_args: {split: test}}"]) == 0
        (run_dir,) = (tmp_path / name).iterdir()
        runs.append(sorted((r["task"], r["token_ids"]) for r in read_trajectories(run_dir)))
    assert runs[0] == runs[1] and [t for t, _ in runs[0]] == [EVAL_TASKS, EVAL_TASKS + 1]
