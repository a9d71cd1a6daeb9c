"""Adapter `trl` (molt-adapter-trl): docs/adapters/trl.md's environment, written for TRL's
`environment_factory` and used unchanged, rolls out token-exactly and trains a few steps.

The tiny random-init model never emits a tool call on its own, so it is imprinted (a few SFT
steps) to call `add` with each row's target and then answer; the code under test is the
adapter, the loopback server and the trainer, unchanged."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import molt_core
from molt_chat import ChatRunner
from molt_core.chat.server import shared_server
from molt_core.config import Config
from molt_core.contracts import RolloutContext
from molt_core.engines.hf import HFEngine
from molt_core.plugins import build_plugins
from molt_tools.view import read_trajectories
from test_chat_server import Recorder, decode, runs

DOC = Path(__file__).parents[1] / "docs" / "adapters" / "trl.md"
ARGS = {"environment": "counter_env:CounterEnv", "data": "data/counter.jsonl",
        "data_args": {"test_fraction": 0.0}, "reward": {"counter_env:used_a_tool": 1.0}}
SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_new_tokens": 40}


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """The doc's files, verbatim, in a directory of their own."""
    out = tmp_path_factory.mktemp("trl_example")
    blocks = re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', DOC.read_text(), re.S)
    assert {t for t, _ in blocks} == {"counter_env.py", "data/counter.jsonl", "counter.yaml"}
    for title, body in blocks:
        (out / title).parent.mkdir(parents=True, exist_ok=True)
        (out / title).write_text(body)
    return out


def schemas() -> list[dict]:
    from transformers.utils import get_json_schema
    import counter_env

    return [get_json_schema(counter_env.CounterEnv().add)]


@pytest.fixture(scope="module")
def caller_dir(tiny_model_dir, example, tmp_path_factory) -> Path:
    """The tiny model (short tools template: short prompts, a quick SFT), imprinted to call
    `add` with the target, then say "Done."."""
    from molt_tools.calculator_model import short_tools_template
    from molt_tools.imprint import imprint

    base = tmp_path_factory.mktemp("trl_base") / "model"
    shutil.copytree(tiny_model_dir, base)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = short_tools_template(tok.chat_template)
    tok.save_pretrained(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(example))
        tools = schemas()
    pairs = []
    for row in map(json.loads, (example / "data/counter.jsonl").read_text().splitlines()):
        msgs = [{"role": "user", "content": row["prompt"][0]["content"]
                 + f" The target is {row['target']}."}]
        args = json.dumps({"amount": row["target"]})
        pairs.append((tok.apply_chat_template(msgs, tools=tools, tokenize=False,
                                              add_generation_prompt=True),
                      f'<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'
                      "<|im_end|>"))
        msgs += [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type":
                  "function", "function": {"name": "add", "arguments": args}}]},
                 {"role": "tool", "tool_call_id": "c", "name": "add",
                  "content": f"The total is {row['target']}."}]
        pairs.append((tok.apply_chat_template(msgs, tools=tools, tokenize=False,
                                              add_generation_prompt=True), "Done.<|im_end|>"))
    return imprint(base, tmp_path_factory.mktemp("trl_caller"), pairs, tol=0.01)


def test_rollout_is_token_exact_with_the_tool_round_trip(caller_dir, example, monkeypatch):
    monkeypatch.chdir(example)
    monkeypatch.syspath_prepend(str(example))
    tok = AutoTokenizer.from_pretrained(caller_dir)
    cfg = Config()
    cfg.model.path = str(caller_dir)
    runner = ChatRunner(cfg, tok, build_plugins(), agent="trl", agent_args=ARGS)

    async def main():
        rec = Recorder(HFEngine(str(caller_dir), seed=3))
        trajs = [await runner.rollout(RolloutContext(g, 0, g, dict(SAMPLING), rec, tok))
                 for g in range(2)]
        await (await shared_server()).close()
        return trajs, rec

    trajs, rec = asyncio.run(main())
    calls = iter(rec.calls)
    for traj in trajs:
        traj.check(len(tok))
        parts = runs(traj)
        assert [p[0] for p in parts] == [False, True, False, True]    # prompt, call, result, end
        for _, ids, lps in (p for p in parts if p[0]):
            _, c = next(calls)
            assert (ids, lps) == (c.token_ids, c.logprobs)            # trainable = sampled
        target = int(re.search(r"The target is (\d+)\.", decode(tok, parts[0][1])).group(1))
        call = re.search(r'"amount": (\d+)', decode(tok, parts[1][1]))
        assert "Tools: add" in decode(tok, parts[0][1])                 # the tool, offered
        assert f"<tool_response>\nThe total is {call.group(1)}.\n</tool_response>" in \
            decode(tok, parts[2][1])                                   # masked tool result
        assert traj.reward == pytest.approx((int(call.group(1)) == target) + 0.1)
    assert next(calls, None) is None


def test_trains_a_few_steps(ray_local, caller_dir, example, monkeypatch, tmp_path):
    monkeypatch.chdir(example)
    monkeypatch.syspath_prepend(str(example))
    run = molt_core.train("counter.yaml", {
        "model.path": str(caller_dir), "trainer.steps": 2, "out_dir": str(tmp_path),
        "rollout.group_size": 2, "check.consistency_every": 1, "log.trajectories_per_step": 4})
    steps = [r for r in run.history if "reward/mean" in r]
    assert len(steps) == 2
    rows = read_trajectories(run.run_dir)
    assert {r["step"] for r in rows} == {0, 1} and len(rows) == 8
    tok = AutoTokenizer.from_pretrained(caller_dir)
    results = 0
    for r in rows:
        masked = tok.decode([t for t, m in zip(r["token_ids"], r["loss_mask"]) if not m])
        results += "<tool_response>" in masked
        assert "The target is" in masked and 0 < sum(r["loss_mask"]) < len(r["loss_mask"])
        on = [abs(a - b) for a, b, m in zip(r["trainer_logprobs"], r["behavior_logprobs"],
                                            r["loss_mask"]) if m]
        assert max(on) < 1e-3                       # the trainer scored what was sampled
    assert results >= 4, "the imprinted policy calls the tool in most rollouts"


BAD = '''
class NoReward:
    def reset(self, **kwargs):
        return None

class Undocumented:
    def reset(self, **kwargs):
        return None
    def get_reward(self):
        return 0.0
    def add(self, amount):
        return amount
'''


def test_bad_environments_are_one_clear_error(example, tmp_path, monkeypatch):
    from molt_trl import TRLEnvironment

    (tmp_path / "bad_envs.py").write_text(BAD)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'bad_envs:NoReward' has no get_reward\(\) method: "
                                         "name reward functions in agent_args.reward"):
        TRLEnvironment(environment="bad_envs:NoReward")
    with pytest.raises(Exception, match="JSON schema for add because it has no docstring"):
        TRLEnvironment(environment="bad_envs:Undocumented")
