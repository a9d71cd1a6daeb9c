"""The reasoning-gym adapter (issue 27): the real package's procedural tasks as env
`reasoning_gym`, rewarded by the task's own scorer, held-out questions kept out of training;
docs/adapters/reasoning_gym.md's example trains token-exactly on a tiny model; an unknown task
name is one clear error."""

from __future__ import annotations

import asyncio
import json
import re
import runpy
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import reasoning_gym
import yaml
from transformers import AutoTokenizer

from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.contracts import RolloutContext
from molt_core.engines.hf import HFEngine
from molt_core.plugins import build_plugins
from molt_core.rollout.eval import EVAL_TASKS
from molt_reasoning_gym import ReasoningGym

DOC = Path(__file__).parents[1] / "docs" / "adapters" / "reasoning_gym.md"
TASK, CONFIG = "chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_new_tokens": 5}


def run(coro):
    return asyncio.run(coro)


def test_items_scorer_and_disjoint_splits():
    own = reasoning_gym.create_dataset(TASK, seed=0, size=10**9, **CONFIG)   # the package's own
    test = ReasoningGym(task=TASK, split="test", config=CONFIG)
    held = {run(test.reset(EVAL_TASKS + i)) for i in range(200)}
    assert len(held) > 150                          # distinct questions, not one repeated
    env, again = ReasoningGym(task=TASK, config=CONFIG), ReasoningGym(task=TASK, config=CONFIG)
    skipped = 0
    for seed in range(400):
        question = run(env.reset(seed))
        assert question == run(again.reset(seed)) and question not in held   # deterministic
        first = next(i for i in range(seed, seed + 50) if own[i]["question"] not in held)
        assert question == own[first]["question"]   # item `seed`, or the next that test lacks
        skipped += first > seed
        answer = env.entry["answer"]
        assert run(env.step(f" {answer}\n"))[1] == 1.0                # the task's scorer
        assert run(env.step(f"It is {answer}."))[1] == own.score_answer(f"It is {answer}.",
                                                                         env.entry) < 1
        assert run(env.step("no idea"))[1] == 0.0
    assert skipped > 0                              # the space is small enough to collide
    tagged = ReasoningGym(task=TASK, config=CONFIG, answer=r"<answer>(.*?)</answer>")
    run(tagged.reset(3))
    answer = tagged.entry["answer"]
    assert run(tagged.step(f"I think. <answer> {answer} </answer> done"))[1] == 1.0
    assert run(tagged.step(answer))[1] == 0.0      # no tag: nothing to score


def recipe(tmp_path, model, **env_args) -> str:
    data = {"name": "rg", "seed": 0, "model": {"path": str(model)}, "out_dir": str(tmp_path),
            "sampling": {"max_new_tokens": 5}, "engine": {"name": "hf"},
            "rollout": {"groups_per_step": 2, "group_size": 4},
            "trainer": {"steps": 2, "lr": 1e-3, "micro_batch_size": 8},
            "agent": {"name": "gym", "args": {"env": "reasoning_gym", "env_args": {
                "task": TASK, "config": CONFIG, **env_args}}},
            "eval": {"every": 2, "prompts": 4, "k": 2,
                     "agent_args": {"env_args": {"split": "test"}}}}
    (tmp_path / "rg.yaml").write_text(yaml.safe_dump(data))
    return str(tmp_path / "rg.yaml")


def test_trains_token_exactly_with_the_scorer_as_reward(tiny_model_dir, tmp_path, monkeypatch):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine, sampled = HFEngine(str(tiny_model_dir), seed=3), []

    async def generate(ids, sampling=None, images=None):
        sampled.append(list((c := await engine.generate(ids, SAMPLING)).token_ids))
        return c

    plugins = build_plugins()
    agent = plugins.get("agent", "gym")(None, tok, plugins, env="reasoning_gym",
                                        env_args={"task": TASK, "config": CONFIG})
    traj = run(agent.rollout(RolloutContext(0, 0, 5, SAMPLING, generate, tok)))
    trainable = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert trainable == sampled[0] and len(sampled) == 1
    env = ReasoningGym(task=TASK, config=CONFIG)
    assert run(env.reset(5)) in tok.decode(traj.token_ids)      # the question is the prompt
    assert traj.reward == run(env.step(tok.decode(trainable, skip_special_tokens=True)))[1]

    # the docs' example, verbatim, on the tiny model in SmolLM2's place
    blocks = dict(re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', DOC.read_text(), re.S))
    assert set(blocks) == {"chain_sum.yaml", "train.py"}
    for title, body in blocks.items():
        (tmp_path / title).write_text(body)
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "smollm2-135m-instruct").symlink_to(tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    result = runpy.run_path("train.py")["run"]
    steps = [r for r in result.history if "reward/mean" in r]
    evals = [r for r in result.history if "eval/time_s" in r]
    assert len(steps) == 2 and [e["step"] for e in evals] == [0, 2]
    env_args = yaml.safe_load(blocks["chain_sum.yaml"])["agent"]["args"]["env_args"]
    env = ReasoningGym(**env_args)
    rows = [r for f in sorted((result.run_dir / "trajectories").glob("*.parquet"))
            for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 64
    for row in rows:        # each saved reward is the task's score of the trained tokens' text
        reply = tok.decode([t for t, m in zip(row["token_ids"], row["loss_mask"]) if m],
                           skip_special_tokens=True)
        assert run(env.reset(row["task"])) in tok.decode(row["token_ids"])
        assert row["reward"] == run(env.step(reply))[1] and json.loads(row["info"]) == {}


def test_unknown_task_is_one_clear_error(tiny_model_dir, tmp_path):
    shipped = Path(__file__).parents[1] / "recipes/cpu/smollm2_reasoning_gym.yaml"
    cfg, _ = load(str(shipped), [f"model.path={tiny_model_dir}"])     # the recipe is valid
    assert cfg.agent.args["env_args"]["task"] == "basic_arithmetic"
    with pytest.raises(ConfigError, match=r"task 'chain_sums' unknown; close names: chain_sum"):
        load(recipe(tmp_path, tiny_model_dir, task="chain_sums"), [])
    tiny = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}   # 100 questions
    with pytest.raises(ValueError, match="train questions in a row are test questions"):
        run(ReasoningGym(task=TASK, config=tiny, test_size=5000).reset(0))


@pytest.mark.parametrize("over", [{"test_size": 400}, {"config": {**CONFIG, "max_digits": 1}},
                                  {"task": "basic_arithmetic"}])
def test_eval_may_not_change_what_decides_the_split(tiny_model_dir, tmp_path, capsys, over):
    """Issue 41: training skips the questions of its own test set only; an eval at test_size 400
    scored items 200-399, some of them training questions. Refused by `eval_agent` (what training
    checks) and `molt validate`; the training values repeated pass."""
    from molt_core.rollout.eval import eval_agent
    from molt_tools.commands import main
    trained = {run(ReasoningGym(task=TASK, config=CONFIG).reset(s)) for s in range(400)}
    wider = ReasoningGym(task=TASK, split="test", config=CONFIG, test_size=400)
    assert trained & {run(wider.reset(EVAL_TASKS + i)) for i in range(400)}     # the overlap
    key = next(iter(over))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for eval_args, refused in ((over, True), ({"task": TASK, "test_size": 200, "config": CONFIG},
                                              False)):
        ev = f"eval.agent_args={json.dumps({'env_args': {'split': 'test', **eval_args}})}"
        cfg, plugins = load(recipe(tmp_path, tiny_model_dir), [ev])
        if not refused:
            assert eval_agent(cfg, plugins, tok).held_out
            continue
        with pytest.raises(ConfigError, match=rf"eval.agent_args.env_args.{key}=.* differs from "
                                              "training's"):
            eval_agent(cfg, plugins, tok)
        assert main(["validate", recipe(tmp_path, tiny_model_dir), ev]) == 2
        assert f"env_args.{key}=" in capsys.readouterr().err
