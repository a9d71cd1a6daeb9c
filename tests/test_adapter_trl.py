"""Adapter `trl` (molt-adapter-trl): docs/adapters/trl.md's environment, written for TRL's
`environment_factory` and used unchanged, rolls out token-exactly and trains a few steps.

The tiny random-init model never emits a tool call on its own, so it is imprinted (a few SFT
steps) to call `add` with each row's target and then answer; the code under test is the
adapter, the loopback server and the trainer, unchanged.

Parity with the real TRL (the `.venv-trl` that `make test` builds): tests/trl_probe.py builds a
`trl.GRPOTrainer(environment_factory=...)` there and runs its own rollout code with scripted
replies; the adapter, given the same replies, must derive the same tools, reward sources,
token ids, tool mask, rewards and reward-function arguments."""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import subprocess
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
from molt_core.trajectory import Completion
from molt_tools.view import read_trajectories
from test_chat_server import Recorder, decode, runs

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "adapters" / "trl.md"
TRL_VENV = ROOT / ".venv-trl"
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
    assert {r["step"] for r in rows} == {1, 2} and len(rows) == 8
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
class NoReset:
    def get_reward(self):
        return 0.0

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
    with pytest.raises(ValueError, match=r"'bad_envs:NoReset' has no reset\(\) method: TRL calls "
                                         "it at the start of each rollout"):
        TRLEnvironment(environment="bad_envs:NoReset")
    with pytest.raises(ValueError, match=r"'bad_envs:NoReward' has no get_reward\(\) method: "
                                         "name reward functions in agent_args.reward"):
        TRLEnvironment(environment="bad_envs:NoReward")
    with pytest.raises(Exception, match="JSON schema for add because it has no docstring"):
        TRLEnvironment(environment="bad_envs:Undocumented")


# --- parity with the real TRL ------------------------------------------------------------------

# TRL's own example environment, verbatim but for the trainer lines that follow it
# (huggingface/trl docs/source/grpo_trainer.md, "### Environments", at f2cd57710ae3): it owns its
# tasks (no dataset: `reset` draws one and returns the prompt) and its reward.
INCREMENT_ENV = '''import random

class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
'''

# A tool whose result does not fit the model's context.
VERBOSE_ENV = '''class Verbose:
    def reset(self, **kwargs):
        self.reads = 0

    def get_reward(self) -> float:
        return float(self.reads)

    def read(self) -> str:
        """
        Read the whole book.

        Returns:
            The book, longer than the model's context.
        """
        self.reads += 1
        return "word " * 3000
'''

# A reward function that records what it is called with (in the cwd: the reward functions are
# cached by name, their modules are not) and scores nothing.
SEEN = '''import json

def seen(prompts, completions, **kwargs):
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions,
                            "kwargs": sorted(kwargs)}) + "\\n")
    return [0.0 for _ in prompts]
'''


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# Scripted replies, the same for every rollout of a case: a tool call and an answer; a failing
# tool and an unknown one in one reply; no tool call.
COUNTER_CASES = [
    {"inputs": [0, 1], "turns": [call("add", '{"amount": 3}') + "<|im_end|>", "Done.<|im_end|>"]},
    {"inputs": [0, 0], "turns": [call("add", '{"amount": "x"}') + "\n" + call("mul", '{"a": 2}')
                                 + "<|im_end|>", "Done.<|im_end|>"]},
    {"inputs": [1, 1], "turns": ["Done.<|im_end|>"]},
]
COUNTER_REWARD = {"counter_env:used_a_tool": 1.0, "seen:seen": 0.5}
# Two rounds of tool calls; seed 4 draws the targets 2 and 3 (TRL's one placeholder row, twice).
INCREMENT_CASES = [{"inputs": [0, 0], "seed": 4, "turns": [
    call("increment", '{"step": 1}') + "<|im_end|>",
    call("increment", '{"step": 2}') + "<|im_end|>", "Done.<|im_end|>"]}]
# A tool result past the context: TRL drops it, ends the rollout and scores it.
VERBOSE_CASES = [{"inputs": [0, 0], "turns": [call("read", "{}") + "<|im_end|>"]}]


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with Qwen2.5's chat template as TRL stores it (so TRL recognizes it and
    parses tool calls as it does for Qwen) and a 2048-token context (its tools preamble alone is
    ~450 tokens; TRL drops a tool result that would reach the context)."""
    from transformers import AutoConfig

    if not (TRL_VENV / ".installed").exists():
        pytest.skip(".venv-trl is absent (`make venv-trl`; `make test` builds it): no parity "
                    "check with the real TRL")
    out = tmp_path_factory.mktemp("trl_qwen") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = AutoConfig.from_pretrained(out)
    config.max_position_embeddings = 2048
    config.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out, model_max_length=2048)
    tok.chat_template = next(TRL_VENV.glob("lib/python3*/site-packages/trl/chat_templates/"
                                           "qwen2_5.jinja")).read_text()
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def envs(example, tmp_path_factory) -> Path:
    """The doc's example, TRL's IncrementEnv, Verbose, the bad environments and `seen`, in one
    directory (the probe's cwd)."""
    out = tmp_path_factory.mktemp("trl_envs")
    shutil.copytree(example, out, dirs_exist_ok=True)
    for name, text in {"increment_env.py": INCREMENT_ENV, "verbose_env.py": VERBOSE_ENV,
                       "bad_envs.py": BAD, "seen.py": SEEN}.items():
        (out / name).write_text(text)
    return out


def specs(model: Path, envs: Path) -> dict:
    counter_rows = [json.loads(r) for r in (envs / "data/counter.jsonl").read_text().splitlines()]
    return {
        "counter": {"model": str(model), "environment": "counter_env:CounterEnv",
                    "reward": COUNTER_REWARD, "rows": counter_rows, "cases": COUNTER_CASES},
        "increment": {"model": str(model), "environment": "increment_env:IncrementEnv",
                      "reward": {"seen:seen": 1.0}, "cases": INCREMENT_CASES},
        "verbose": {"model": str(model), "environment": "verbose_env:Verbose",
                    "reward": {"seen:seen": 1.0}, "max_completion_length": 4096,
                    "cases": VERBOSE_CASES},     # the context, not TRL's completion budget
        "no_reset": {"model": str(model), "environment": "bad_envs:NoReset"},
        "no_reward": {"model": str(model), "environment": "bad_envs:NoReward"},
        "undocumented": {"model": str(model), "environment": "bad_envs:Undocumented",
                         "cases": [{"inputs": [0, 0], "turns": ["Done.<|im_end|>"]}]},
    }


@pytest.fixture(scope="module")
def trl(qwen_dir, envs) -> dict:
    """tests/trl_probe.py in .venv-trl, once for every spec: what GRPOTrainer derives and does."""
    (envs / "specs.json").write_text(json.dumps(specs(qwen_dir, envs)))
    p = subprocess.run([TRL_VENV / "bin" / "python", ROOT / "tests" / "trl_probe.py",
                        "specs.json", "trl.json"], cwd=envs, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((envs / "trl.json").read_text())


class Scripted:
    """A fake engine: the k-th call replies `turns[k]` (the random model would never call a
    tool); TRL's side replays the same ids."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.replies = [tok(t, add_special_tokens=False)["input_ids"] for t in turns]

    async def __call__(self, prompt_ids: list[int], sampling: dict) -> Completion:
        ids = self.replies.pop(0)
        return Completion(ids, [0.0] * len(ids), [0] * len(ids))


def molt_view(model: Path, args: dict, cases: list[dict]) -> list[list[dict]]:
    """The adapter's rollouts of `cases` (task i: row i, in order), with what `seen` saw."""
    tok = AutoTokenizer.from_pretrained(model)
    cfg = Config()
    cfg.model.path = str(model)
    runner = ChatRunner(cfg, tok, build_plugins(), agent="trl", agent_args=args)

    async def main():
        out = []
        for case in cases:
            random.seed(case.get("seed", 0))      # as the probe does before TRL's resets
            out.append([])
            for i in case["inputs"]:
                Path("seen.jsonl").unlink(missing_ok=True)
                traj = await runner.rollout(RolloutContext(i, 0, i, dict(SAMPLING), Scripted(
                    tok, case["turns"]), tok))
                traj.check(len(tok))
                out[-1].append({"traj": traj, "seen": json.loads(Path("seen.jsonl").read_text())})
        await (await shared_server()).close()
        return out

    return asyncio.run(main())


def assert_same_rollouts(trl: dict, molt: list[list[dict]]) -> None:
    """Per rollout: token ids, mask (the prompt and tool results masked, the replies trained),
    reward, and the prompts/completions a reward function gets; TRL passes `completion_ids`,
    `trainer_state`, `log_extra` and `log_metric` besides (docs/adapters/trl.md)."""
    for t, m in zip(trl["cases"], molt, strict=True):
        assert "error" not in t, t.get("error")
        for i, r in enumerate(m):
            traj, got = r["traj"], r["seen"]
            assert traj.token_ids == t["prompt_ids"][i] + t["completion_ids"][i]
            assert traj.loss_mask == [0] * len(t["prompt_ids"][i]) + t["tool_mask"][i]
            assert traj.reward == pytest.approx(t["reward"][i])
            assert got["prompts"] == [t["prompts"][i]]
            assert got["completions"] == [t["completions"][i]]
            assert set(got["kwargs"]) == set(trl["reward_kwargs"]) - {
                "prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                "log_metric"}


def test_counter_env_matches_real_trl(trl, qwen_dir, envs, monkeypatch):
    from molt_trl import TRLEnvironment

    monkeypatch.chdir(envs)
    monkeypatch.syspath_prepend(str(envs))
    view = trl["counter"]
    args = {**ARGS, "reward": COUNTER_REWARD,
            "data_args": {"test_fraction": 0.0, "shuffle": False}}     # task i: row i
    agent = TRLEnvironment(**args)
    assert view["tools"] == agent.schemas and not view["chat_template_swapped"]
    assert view["reward_func_names"] == [f.__name__ for _, f, _ in agent.functions] + [
        "CounterEnv"]
    assert view["reward_weights"] == [w for *_, w in agent.functions] + [1.0]
    assert_same_rollouts(view, molt_view(qwen_dir, args, COUNTER_CASES))
    tool_results = [m["content"] for m in view["cases"][1]["completions"][0] if m["role"] == "tool"]
    assert tool_results == ["{'error': \"unsupported operand type(s) for +=: 'int' and 'str'\"}",
                            "{'error': 'Tool mul not found.'}"]


def test_trl_docs_increment_env_matches_real_trl(trl, qwen_dir, envs, monkeypatch):
    """No dataset: `reset` draws the task and its string is the prompt (seeded alike)."""
    monkeypatch.chdir(envs)
    monkeypatch.syspath_prepend(str(envs))
    view = trl["increment"]
    assert [t["function"]["name"] for t in view["tools"]] == ["increment"]
    assert view["reward_func_names"] == ["seen", "IncrementEnv"]
    args = {"environment": "increment_env:IncrementEnv", "reward": {"seen:seen": 1.0}}
    assert_same_rollouts(view, molt_view(qwen_dir, args, INCREMENT_CASES))
    assert sorted(view["cases"][0]["reward"]) == [0.0, 1.0]     # one target reached, one not


def test_a_tool_result_past_the_context_ends_the_rollout_as_in_trl(trl, qwen_dir, envs,
                                                                   monkeypatch):
    monkeypatch.chdir(envs)
    monkeypatch.syspath_prepend(str(envs))
    view = trl["verbose"]
    args = {"environment": "verbose_env:Verbose", "reward": {"seen:seen": 1.0}}
    rollouts = molt_view(qwen_dir, args, VERBOSE_CASES)
    assert_same_rollouts(view, rollouts)
    assert view["cases"][0]["reward"] == [1.0, 1.0]          # the tool ran; its result is dropped
    assert [m["role"] for m in view["cases"][0]["completions"][0]] == ["assistant"]
    assert all(r["traj"].truncated for r in rollouts[0])


def test_bad_environments_are_refused_by_trl_too(trl):
    """What the adapter refuses (test_bad_environments_are_one_clear_error), TRL refuses too;
    an undocumented tool only when it first renders a prompt."""
    assert trl["no_reset"]["error"] == ("ValueError: Each environment instance returned by "
                                        "`environment_factory` must define a callable `reset`.")
    assert trl["no_reward"]["error"].startswith("ValueError: No reward source provided.")
    assert "JSON schema for add because it has no docstring" in \
        trl["undocumented"]["cases"][0]["error"]
