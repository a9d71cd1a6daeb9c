"""Held-out evaluation (molt_core.rollout.eval): rows in the training loop, `molt eval` standalone, and
the arithmetic env's train/test split. Real Ray, HF engine, tiny models."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml

from types import SimpleNamespace

from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.rollout.eval import EVAL_TASKS, info_means
from molt_core.rollout.generator import Generator
from molt_core.trajectory import Trajectory
from molt_core.trainer import train
from molt_examples import Arithmetic
from molt_gym import MathProblems
from molt_tools.commands import main


def test_arithmetic_splits_are_disjoint_and_answers_right():
    def problems(split: str, seeds: range) -> dict[str, str]:
        out = {}
        for s in seeds:
            env = Arithmetic(split=split)
            q = asyncio.run(env.reset(s))
            out[q] = env.row["answer"]
        return out
    train_set, test_set = problems("train", range(400)), problems("test", range(EVAL_TASKS,
                                                                                EVAL_TASKS + 400))
    assert len(train_set) > 300 and len(test_set) > 300
    assert not train_set.keys() & test_set.keys()
    ops = {"more": int.__add__, "left": int.__sub__, "total": int.__mul__, "each": int.__floordiv__}
    for q, a in test_set.items():
        x, y = (int(w) for w in q.replace(".", " ").split() if w.isdigit())
        assert int(a) == next(f for k, f in ops.items() if k in q)(x, y), q
    env = Arithmetic(split="test")
    asyncio.run(env.reset(1))
    assert asyncio.run(env.step(f"It is {env.row['answer']}."))[1] == 1.0
    assert asyncio.run(env.step("no idea"))[1] == 0.0
    with pytest.raises(ValueError, match="ops"):
        Arithmetic(ops="^")


def test_math_eval_prompts_are_never_training_prompts(tiny_model_dir, tmp_path):
    """The DAPO-Math recipe's env: 32 eval prompts vs the first 200 training groups' (on main all
    32 were among them: row = task mod len for both)."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)})
                            + "\n" for i in range(300)))
    cfg = load(None, [f"model.path={tiny_model_dir}", "agent.args.env=math",
                      f"agent.args.env_args={{data: {data}}}"])[0]
    gen = SimpleNamespace(cfg=cfg)       # the real task mapping of training's generator

    def prompts(tasks, **args) -> set[str]:
        env = MathProblems(data=str(data), **args)
        return {asyncio.run(env.reset(t)) for t in tasks}
    trained = prompts(Generator.task_of(gen, g) for g in range(200))
    held_out = prompts(range(EVAL_TASKS, EVAL_TASKS + 32), split="test")
    assert len(trained) > 150 and len(held_out) >= 20
    assert not trained & held_out
    rows = [{"prompt": "p1", "answer": "1", "split": "test"}, {"prompt": "p2", "answer": "2"}]
    (tmp_path / "declared.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert prompts(range(5), split="test") | prompts(range(5)) <= {f"What is {i} + {i}?"
                                                                   for i in range(300)}
    declared = str(tmp_path / "declared.jsonl")
    assert {asyncio.run(MathProblems(data=declared, split="test", test_fraction=0.0).reset(t))
            for t in range(4)} == {"p1"}
    with pytest.raises(ValueError, match="no 'train' rows"):
        MathProblems(data=declared, test_fraction=1.0)


def test_eval_refuses_an_env_without_a_held_out_split(tiny_recipe, tmp_path):
    """next_letter has no split: its eval tasks would be training prompts. Refused before Ray
    starts, by training and by `molt eval`."""
    cfg, plugins = load(tiny_recipe, ["eval.every=1", "trainer.steps=1"])
    with pytest.raises(ConfigError, match="next_letter.* serves no held-out split"):
        train(cfg, plugins, tmp_path, progress=False)
    model = yaml.safe_load(open(tiny_recipe))["model"]["path"]
    assert main(["eval", model, tiny_recipe]) == 2


def test_info_means_average_numbers_and_bools_of_the_rollouts_holding_them():
    trajs = [Trajectory(info={"tool_calls": 2, "formatted": True, "answer": "4", "row": 7}),
             Trajectory(info={"tool_calls": 0, "formatted": False, "columns": {"a": 1}}),
             Trajectory(info={"formatted": True})]
    assert info_means(trajs, "eval/greedy/info/") == {
        "eval/greedy/info/formatted": 2 / 3, "eval/greedy/info/tool_calls": 1.0}


ARITHMETIC = ["agent.args.env=arithmetic", "eval.agent_args={env_args: {split: test}}"]


def test_eval_rows_in_training_and_standalone(ray_local, tiny_recipe, tmp_path, capsys):
    over = [*ARITHMETIC, "trainer.steps=2", "eval.every=2", "eval.prompts=3", "eval.k=2",
            "rollout.groups_per_step=2", "rollout.group_size=2"]
    cfg, plugins = load(tiny_recipe, over)
    history = train(cfg, plugins, tmp_path, progress=False)
    evals = [h for h in history if "eval/time_s" in h]
    assert [h["step"] for h in evals] == [0, 2]           # before training and after the end
    assert sum("reward/mean" in h for h in history) == 2
    for h in evals:
        assert 0 <= h["eval/sampled/pass@1"] <= h["eval/sampled/pass@2"] <= 1
        assert 0 <= h["eval/greedy/pass@1"] <= 1 and "eval/greedy/pass@2" not in h
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "eval/time_s" in r] == [0, 2]
    # the eval rollouts are saved like training's (molt view --eval), their numeric info averaged
    from molt_tools.view import read_trajectories
    saved = read_trajectories(tmp_path / "trajectories" / "eval")
    assert sorted({r["step"] for r in saved}) == [0, 2] and len(saved) == 2 * 3 * (1 + 2)
    assert {r["task"] for r in saved} == {EVAL_TASKS + g for g in range(3)}
    greedy = [Trajectory(info=json.loads(r["info"])) for r in saved if r["step"] == 0]
    greedy = [t for t in greedy if t.info.pop("eval") == "greedy"]
    assert len(greedy) == 3 and {k: v for k, v in evals[0].items() if "/info/" in k} == \
        info_means(greedy, "eval/greedy/info/")
    assert main(["view", str(tmp_path), "--eval", "--terminal", "--limit", "1"]) == 0
    # standalone: the same held-out prompts on the same (untrained) model, greedy is greedy
    model = yaml.safe_load(open(tiny_recipe))["model"]["path"]
    capsys.readouterr()
    assert main(["eval", model, tiny_recipe, *ARITHMETIC, "eval.prompts=3", "eval.k=0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval/greedy/pass@1"] == evals[0]["eval/greedy/pass@1"]
    assert "eval/sampled/pass@1" not in out
    assert main(["eval", str(tmp_path / "nothing"), tiny_recipe]) == 2


def test_eval_leaves_the_training_samples_unchanged(ray_local, tiny_recipe, tmp_path):
    """Eval requests carry seeds of their own: with eval on, every training token and metric is
    what it is with eval off (on main eval drew from the engines' training stream)."""
    from molt_tools.view import read_trajectories

    over = [*ARITHMETIC, "trainer.steps=3", "rollout.groups_per_step=2", "rollout.group_size=4",
            "sampling.max_new_tokens=6", "log.trajectories_every=1"]

    def run(name: str, *extra: str) -> tuple[list, list]:
        cfg, plugins = load(tiny_recipe, [*over, *extra])
        (tmp_path / name).mkdir()
        history = train(cfg, plugins, tmp_path / name, progress=False)
        rows = [{k: v for k, v in h.items() if not k.endswith("_s") and "memory" not in k}
                for h in history if "reward/mean" in h]       # all but times and memory
        samples = sorted((r["step"], r["group_id"], r["rollout_id"], r["token_ids"],
                          r["behavior_logprobs"]) for r in read_trajectories(tmp_path / name))
        return rows, samples
    off = run("off")
    on = run("on", "eval.every=1", "eval.prompts=2", "eval.k=2")
    assert len(on[1]) == len(off[1]) == 3 * 2 * 4
    assert on == off


SPLIT_AGENTS = '''
from molt_chat import ChatAgent
from molt_core import hookimpl


class Split(ChatAgent):
    def __init__(self, split: str = "train") -> None:
        self.split = split


class NoSplit(ChatAgent):
    pass


@hookimpl
def molt_chat_agents():
    return {"split_agent": Split, "no_split": NoSplit}
'''


def test_eval_takes_a_chat_agent_whose_class_has_a_test_split(tiny_recipe, tmp_path):
    """The chat agent follows the gym rule: held out when eval selects `split: test` and the
    agent's class takes `split`; otherwise eval is refused before anything starts."""
    from molt_core.rollout.eval import eval_agent
    from transformers import AutoTokenizer
    (tmp_path / "split_agents.py").write_text(SPLIT_AGENTS)
    common = ["agent.name=chat", "eval.every=1"]
    plugin = [str(tmp_path / "split_agents.py")]
    cfg, plugins = load(tiny_recipe, [*common, "agent.args={agent: split_agent}",
                                      "eval.agent_args={agent_args: {split: test}}"], plugin)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    agent = eval_agent(cfg, plugins, tok)
    assert agent.held_out and agent.agent_args == {"split": "test"}
    for args, ev in (("{agent: split_agent}", "{}"), ("{agent: no_split}", "{agent_args: {}}")):
        cfg, plugins = load(tiny_recipe, [*common, f"agent.args={args}", f"eval.agent_args={ev}"],
                            plugin)
        with pytest.raises(ConfigError, match="agent 'chat'.* serves no held-out split"):
            eval_agent(cfg, plugins, tok)


@pytest.mark.parametrize("env, over, key", [
    ("dataset", {"test_fraction": 0.3}, "test_fraction"),
    ("math", {"test_fraction": 0.3}, "test_fraction"),
    ("dataset", {"data": "other.jsonl"}, "data"),
    ("dataset", {"prompt": "answer"}, "prompt"),
])
def test_eval_refuses_an_override_of_what_decides_the_split(tiny_recipe, tmp_path, monkeypatch,
                                                            capsys, env, over, key):
    """Issue 41: 1000 rows, trained at test_fraction 0.1, evaluated at 0.3: the test split held
    ~200 training rows. Refused by training's check (`eval_agent`) and by `molt validate`; the
    same value as training's, or a change of what does not split (the reward), passes."""
    from molt_core.rollout.eval import eval_agent
    from molt_gym import Dataset
    from transformers import AutoTokenizer
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text("def one(completions, **kw):\n"
                                           "    return [1.0] * len(completions)\ntwo = one\n")
    for name in ("rows.jsonl", "other.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": f"{i} + {i}?",
                                                         "answer": str(2 * i)}) + "\n"
                                             for i in range(1000)))
    rows = str(tmp_path / "rows.jsonl")    # absolute: molt_gym.envs caches rows by path
    train_rows = Dataset(data=rows, reward="my_reward:one").rows
    test_rows = Dataset(data=rows, reward="my_reward:one", split="test", test_fraction=0.3).rows
    assert len(set(map(repr, train_rows)) & set(map(repr, test_rows))) > 150   # the overlap
    env_args = {"data": rows, **({"reward": "my_reward:one"} if env == "dataset" else {})}
    common = ["eval.every=1", f"agent.args.env={env}",
              f"agent.args.env_args={json.dumps(env_args)}"]
    cfg, plugins = load(tiny_recipe, [*common, "eval.agent_args="
                                      + json.dumps({"env_args": {"split": "test", **over}})])
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    with pytest.raises(ConfigError, match=rf"eval.agent_args.env_args.{key}=.* differs from "
                                          rf"training's .*Set it in agent.args.env_args.{key}"):
        eval_agent(cfg, plugins, tok)
    assert main(["validate", tiny_recipe, *common, "eval.agent_args="
                 + json.dumps({"env_args": {"split": "test", **over}})]) == 2
    assert f"eval.agent_args.env_args.{key}=" in capsys.readouterr().err
    same = {"split": "test", "test_fraction": 0.1, "data": rows}
    if env == "dataset":        # scoring eval another way does not move rows
        same |= {"prompt": "prompt", "reward": "my_reward:two"}
    cfg, plugins = load(tiny_recipe, [*common, f"eval.agent_args={json.dumps({'env_args': same})}"])
    assert eval_agent(cfg, plugins, tok).held_out
