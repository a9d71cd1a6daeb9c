"""molt-adapter-verifiers: environments written for the real `verifiers` package (PyPI), used
unchanged, roll out against the loopback chat server and train; their rubric's score is the reward.

The environments under test are verifiers' own examples, vendored unmodified in
tests/verifiers_envs/ (each file's header names its source, commit and license) and loaded by id
through verifiers' own `load_environment`, which imports the module as it does an installed
environment: `tool-test` (its environments/tool_test: a `ToolEnv` of four tools, a dataset
generated in `load_environment`, a rubric comparing the tools called with the row's) and
`first-environment` (its docs' "Your First Environment": a `SingleTurnEnv`). Its other examples
download data, call a judge or need a sandbox, so this module adds one in verifiers' style for
what those two never reach, text added between sampled turns: `load_environment` below (a
`MultiTurnEnv` with `env_response`, a `ToolEnv` whose tool runs); its env id is
`test-adapter-verifiers` (verifiers imports the module `test_adapter_verifiers`).

Token identity is checked against a recorder around the engine's `generate`: every trainable run
of a trajectory is one sampled completion (ids and log-probs as the engine returned them), and
everything else (prompt, tool definitions, "Are you sure?", the tool's result) is the engine's
prompt, masked. The tiny random-init model never emits a tool call on its own, so it is imprinted
(a few SFT steps) to make the calls; the code under test is verifiers' and the adapter's, unchanged.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import openai
import pyarrow.parquet as pq
import pytest
import verifiers as vf
from datasets import Dataset
from transformers import AutoTokenizer

from molt_chat import ChatRunner
from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.contracts import RolloutContext
from molt_core.engines.hf import HFEngine
from molt_core.plugins import build_plugins
from molt_core.trainer import train
from molt_tools.calculator_model import short_tools_template
from molt_tools.imprint import imprint
from molt_tools.commands import main

from common import toy_recipe

ENV_ID = "test-adapter-verifiers"
TOOL_TEST = {"num_train_examples": 5, "num_eval_examples": 1}   # rows 0-4; row 4 calls two tools


# ---- ours, in verifiers' style: text added between two sampled turns -----------------------

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class DoubleCheckEnv(vf.MultiTurnEnv):
    """Asks once more after the first answer; the rubric scores the last one."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        return [vf.UserMessage(content="Are you sure?")]


def load_environment(kind: str = "tool", num_examples: int = 4) -> vf.Environment:
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)}
            for a in range(2, 4) for b in range(2, 4)][:num_examples]
    parser = vf.Parser()

    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    rubric = vf.Rubric(funcs=[correct_answer], weights=[1.0], parser=parser)
    common = dict(dataset=Dataset.from_list(rows), parser=parser, rubric=rubric)
    if kind == "multi_turn":
        return DoubleCheckEnv(max_turns=2, **common)
    return vf.ToolEnv(tools=[add], max_turns=3, **common)


# ---- fixtures and checks -----------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _upstream_envs() -> Iterator[None]:
    """verifiers' examples importable by id, as `pip install` of an environment makes them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(Path(__file__).parent / "verifiers_envs"))
        yield


def call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


CALL = call("add", {"a": 2, "b": 2})
TOOL_TEST_X = {"tool_A": 1, "tool_B": "a", "tool_C": 1.5, "tool_D": True}   # the calls' x


def tool_test_reply(names: list[str]) -> str:
    """tool-test's reply: the tools of its row, called in one message."""
    return "\n".join(call(n, {"x": TOOL_TEST_X[n]}) for n in names) + "<|im_end|>"


@pytest.fixture(scope="module")
def caller_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (short tools template: `Tools: name ...`), imprinted to call on tool-test's
    rows 0 and 4 the tools each names, and to call `add` on "What is 2 + 2?" and answer with its
    result; the prompts are rendered with the tools as verifiers sends them."""
    base = tmp_path_factory.mktemp("vf") / "base"
    shutil.copytree(tiny_model_dir, base)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = short_tools_template(tok.chat_template)
    tok.save_pretrained(base)
    client = vf.OpenAIChatCompletionsClient(openai.AsyncOpenAI(api_key="-", base_url="http://x"))

    def prompt(env: vf.Environment, messages: list) -> str:
        tools = [asyncio.run(client.to_native_tool(t)) for t in env.tool_defs]
        return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
    upstream = vf.load_environment("tool-test", **TOOL_TEST)
    pairs = [(prompt(upstream, list(r["prompt"])), tool_test_reply(r["info"]["tool_names"]))
             for r in upstream.get_dataset().select([0, 4])]
    ours, first = load_environment("tool", num_examples=1), [
        {"role": "user", "content": "What is 2 + 2?"}]
    then = first + [{"role": "assistant", "content": "", "tool_calls": [{
        "id": "c", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "4"}]
    pairs += [(prompt(ours, first), CALL + "<|im_end|>"), (prompt(ours, then), "4<|im_end|>")]
    return imprint(base, base.parent / "caller", pairs, tol=0.005)


class Recorder:
    """The engine's generate, recording what it was given and what it returned."""

    def __init__(self, generate) -> None:
        self.generate, self.calls = generate, []

    async def __call__(self, prompt_ids, sampling=None, *args, **kwargs):
        c = await self.generate(prompt_ids, sampling, *args, **kwargs)
        self.calls.append((list(prompt_ids), c))
        return c


def check_token_exact(token_ids, loss_mask, logprobs, calls) -> int:
    """Each maximal trainable run is a recorded completion (ids and log-probs) whose prompt is
    everything before it (one segment: the template never re-renders here); return the number
    of runs, i.e. of model calls in the trajectory."""
    token_ids, logprobs, runs, i = list(token_ids), list(logprobs), 0, 0
    while i < len(loss_mask):
        j = i
        while j < len(loss_mask) and loss_mask[j]:
            j += 1
        if j > i:
            sampled = [(c.token_ids, c.logprobs) for p, c in calls if p == token_ids[:i]]
            assert (token_ids[i:j], logprobs[i:j]) in sampled
            runs += 1
        i = j + 1
    return runs


SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0}


def roll_out(model_dir: Path, env: str, env_args: dict, tasks: tuple[int, ...],
             max_new_tokens: int) -> Iterator[tuple[object, str, str, int]]:
    """Rollouts of `tasks` through chat agent `verifiers` on a recorded seeded engine; each
    (trajectory, masked text, sampled text, runs of sampled tokens) once checked token-exact."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    runner = ChatRunner(SimpleNamespace(model=SimpleNamespace(path=str(model_dir))), tok,
                        build_plugins(), agent="verifiers",
                        agent_args={"env": env, "env_args": env_args})
    rec = Recorder(HFEngine(str(model_dir), seed=0).generate)
    sampling = {**SAMPLING, "max_new_tokens": max_new_tokens,
                "stop_token_ids": [tok.convert_tokens_to_ids("<|im_end|>")]}

    async def run():
        try:
            return [await runner.rollout(RolloutContext(0, i, task, sampling, rec, tok))
                    for i, task in enumerate(tasks)]
        finally:
            await runner.aclose()
    for traj in asyncio.run(run()):
        runs = check_token_exact(traj.token_ids, traj.loss_mask, traj.logprobs, rec.calls)
        yield traj, *(tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m == keep])
                      for keep in (0, 1)), runs


@pytest.mark.parametrize("env, env_args, turns, env_text", [
    ("first-environment", {}, 1, None), (ENV_ID, {"kind": "multi_turn"}, 2, "Are you sure?")])
def test_single_and_multi_turn_envs_roll_out_token_exactly(tiny_model_dir, env, env_args, turns,
                                                           env_text):
    rows = vf.load_environment(env, **env_args).get_dataset()
    for (traj, masked, _, runs), row in zip(
            roll_out(tiny_model_dir, env, env_args, (1, 6), 6), (1, 6 % len(rows))):
        assert runs == turns == traj.info["verifiers/num_turns"]
        assert traj.info["example_id"] == row
        assert traj.reward == traj.info["verifiers/correct_answer"]     # the rubric's score
        assert rows[row]["prompt"][-1]["content"] in masked
        assert env_text is None or env_text in masked


def test_tool_envs_roll_out_token_exactly_parallel_calls_and_results_masked(caller_dir):
    """tool-test: row 4's two calls, sampled in one reply, reach the env as two tool_calls (its
    rubric wants both, and `max_turns=1` scores the call itself); ours: the tool's result is
    in the trajectory, masked, before the sampled answer."""
    rows = vf.load_environment("tool-test", **TOOL_TEST).get_dataset()
    for (traj, masked, sampled, runs), row in zip(
            roll_out(caller_dir, "tool-test", TOOL_TEST, (0, 4), 96), (0, 4)):
        names = rows[row]["info"]["tool_names"]
        assert runs == 1 and traj.info["example_id"] == row
        assert "Tools: tool_A tool_B tool_C tool_D" in masked       # verifiers' tool defs
        assert rows[row]["prompt"][-1]["content"] in masked
        assert sampled == tool_test_reply(names)
        assert traj.info["verifiers/total_tool_calls"] == len(names)
        assert traj.reward == traj.info["verifiers/tool_call_reward_func"] == 1.0
    ((traj, masked, sampled, runs),) = roll_out(caller_dir, ENV_ID, {"kind": "tool"}, (0,), 32)
    assert runs == 2 and traj.info["verifiers/add_calls"] == 1
    assert "<tool_response>\n4\n</tool_response>" in masked and CALL in sampled
    assert traj.reward == traj.info["verifiers/correct_answer"]


def test_verifiers_tool_test_example_trains_token_exactly(caller_dir, tmp_path, monkeypatch):
    """tool-test's row 0 (call tool_A), two steps of 4 rollouts on the training path."""
    calls, real = [], HFEngine.generate_batch

    async def generate_batch(self, prompts, samplings, *args, **kwargs):   # the training path's
        outs = await real(self, prompts, samplings, *args, **kwargs)
        calls.extend((list(p), c) for p, c in zip(prompts, outs))
        return outs
    monkeypatch.setattr(HFEngine, "generate_batch", generate_batch)
    cfg, plugins = load(toy_recipe(
        tmp_path, caller_dir, sampling={"max_new_tokens": 64},
        rollout={"groups_per_step": 1, "group_size": 4},
        trainer={"steps": 2, "micro_batch_size": 8},
        agent={"name": "chat", "args": {"agent": "verifiers", "agent_args": {
            "env": "tool-test", "env_args": {**TOOL_TEST, "num_train_examples": 1}}}}), [])
    (tmp_path / "run").mkdir()
    history = train(cfg, plugins, tmp_path / "run", progress=False)
    assert len(history) == 2 and all(h["rollout/trajectories"] == 4 for h in history)
    tok = AutoTokenizer.from_pretrained(caller_dir)
    called = 0
    for path in sorted((tmp_path / "run" / "trajectories").glob("*.parquet")):
        for r in pq.read_table(path).to_pylist():
            info = json.loads(r["info"])
            assert check_token_exact(r["token_ids"], r["loss_mask"], r["behavior_logprobs"],
                                     calls) == info["verifiers/num_turns"] == 1
            assert r["reward"] == info["verifiers/tool_call_reward_func"]   # the rubric's score
            masked = tok.decode([t for t, m in zip(r["token_ids"], r["loss_mask"]) if not m])
            assert "Call the following tools with arguments of your choice: ['tool_A']" in masked
            if r["reward"] == 1.0:
                called += 1
                sampled = tok.decode([t for t, m in zip(r["token_ids"], r["loss_mask"]) if m])
                assert call("tool_A", {"x": 1}) in sampled
    assert called >= 1


@pytest.mark.parametrize("env, env_args, error", [
    ("no-such-env", {}, "ValueError: Could not import 'no-such-env' environment"),
    ("tool-test", {"num_examples": 3}, "RuntimeError: Failed to load environment 'tool-test': "
                                       "load_environment\\(\\) got an unexpected keyword "
                                       "argument 'num_examples'")])
def test_a_bad_env_is_one_clear_error_before_anything_starts(tiny_model_dir, tmp_path, env,
                                                             env_args, error):
    recipe = toy_recipe(tmp_path, tiny_model_dir, agent={"name": "chat", "args": {
        "agent": "verifiers", "agent_args": {"env": env, "env_args": env_args}}})
    with pytest.raises(ConfigError, match=f"agent.args.agent_args.env '{env}': {error}"):
        load(recipe, [])


def test_the_docs_example_trains(tiny_chars_dir, tmp_path, monkeypatch, capsys):
    doc = Path(__file__).parents[1] / "docs" / "adapters" / "verifiers.md"
    blocks = dict(re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', doc.read_text(), re.S))
    assert set(blocks) == {"letters_env.py", "verifiers_letters.yaml"}
    for name, body in blocks.items():
        (tmp_path / name).write_text(body)
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "tiny-chars").symlink_to(tiny_chars_dir)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "verifiers_letters.yaml", "trainer.steps=1", "--no-progress"]) == 0
    assert "reward: first step" in capsys.readouterr().out
    (run,) = (tmp_path / "runs").iterdir()
    (saved,) = (run / "trajectories").glob("*.parquet")
    infos = [json.loads(i) for i in pq.read_table(saved, columns=["info"])["info"].to_pylist()]
    assert len(infos) == 64 and {i["example_id"] for i in infos} == set(range(7))
    assert all(i["verifiers/next_letter"] in (0.0, 1.0) for i in infos)
