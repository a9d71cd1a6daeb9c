"""molt-adapter-verifiers: environments written for the real `verifiers` package (PyPI), used
unchanged, roll out against the loopback chat server and train; their rubric's score is the reward.

This module is also the environment: `load_environment` below is written in verifiers' own style
(a module exposing `load_environment(**env_args)` that returns a `vf.Environment`: a dataset with
question/answer columns, a `vf.Rubric` of reward functions, a `SingleTurnEnv`, a `MultiTurnEnv`
with `env_response`, a `ToolEnv` of plain Python functions), so its env id is
`test-adapter-verifiers` (verifiers imports the module `test_adapter_verifiers`).

Token identity is checked against a recorder around the engine's `generate`: every trainable run
of a trajectory is one sampled completion (ids and log-probs as the engine returned them), and
everything else (prompt, "Are you sure?", the tool's result) is the engine's prompt, masked.
"""

from __future__ import annotations

import asyncio
import json
import re
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
from molt_tools.imprint import imprint
from molt_tools.commands import main
from molt_tools.tiny import build_tiny_model

from common import toy_recipe

ENV_ID = "test-adapter-verifiers"


# ---- the environment, as a verifiers user writes it ----------------------------------------

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
    if kind == "single_turn":
        return vf.SingleTurnEnv(**common)
    if kind == "multi_turn":
        return DoubleCheckEnv(max_turns=2, **common)
    return vf.ToolEnv(tools=[add], max_turns=3, **common)


# ---- fixtures and checks -----------------------------------------------------------------

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def caller_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model imprinted (in-test SFT) to call `add` on row 0 and answer with its result; its
    tokenizer is trained on those texts so that the tools preamble fits the 512-token context."""
    env = load_environment("tool", num_examples=1)
    client = vf.OpenAIChatCompletionsClient(openai.AsyncOpenAI(api_key="-", base_url="http://x"))
    tools = [asyncio.run(client.to_native_tool(t)) for t in env.tool_defs]   # as verifiers sends
    base = build_tiny_model(tmp_path_factory.mktemp("vf") / "base", "qwen3")
    tok = AutoTokenizer.from_pretrained(base)
    first = [{"role": "user", "content": "What is 2 + 2?"}]
    then = first + [{"role": "assistant", "content": "", "tool_calls": [{
        "id": "c", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "4"}]
    pairs = [(tok.apply_chat_template(m, tools=tools, tokenize=False, add_generation_prompt=True),
              reply) for m, reply in ((first, CALL + "<|im_end|>"), (then, "4<|im_end|>"))]
    base = build_tiny_model(base.parent / "fitted", "qwen3",
                            extra_corpus=[p + r for p, r in pairs] * 20)
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
            "repetition_penalty": 1.0, "max_new_tokens": 6}


@pytest.mark.parametrize("kind, turns, env_text", [("single_turn", 1, None),
                                                   ("multi_turn", 2, "Are you sure?")])
def test_single_and_multi_turn_envs_roll_out_token_exactly(tiny_model_dir, kind, turns,
                                                           env_text):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    runner = ChatRunner(SimpleNamespace(model=SimpleNamespace(path=str(tiny_model_dir))), tok,
                        build_plugins(), agent="verifiers",
                        agent_args={"env": ENV_ID, "env_args": {"kind": kind}})
    engine = HFEngine(str(tiny_model_dir), seed=0)
    rec = Recorder(engine.generate)
    sampling = {**SAMPLING, "stop_token_ids": [tok.convert_tokens_to_ids("<|im_end|>")]}

    async def main():
        try:
            return [await runner.rollout(RolloutContext(0, i, task, sampling, rec, tok))
                    for i, task in enumerate((1, 6))]
        finally:
            await runner.aclose()
    for traj, row in zip(asyncio.run(main()), (1, 2)):      # task 6 is row 6 % 4
        assert check_token_exact(traj.token_ids, traj.loss_mask, traj.logprobs, rec.calls) == turns
        assert traj.info["example_id"] == row and traj.info["verifiers/num_turns"] == turns
        assert traj.reward == traj.info["verifiers/correct_answer"]
        question = load_environment(kind).get_dataset()[row]["question"]
        masked = tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if not m])
        assert question in masked and (env_text is None or env_text in masked)


def test_a_tool_env_trains_token_exactly_and_its_rubric_is_the_reward(caller_dir, tmp_path,
                                                                      monkeypatch):
    calls, real = [], HFEngine.generate_batch

    async def generate_batch(self, prompts, samplings, *args, **kwargs):   # the training path's
        outs = await real(self, prompts, samplings, *args, **kwargs)
        calls.extend((list(p), c) for p, c in zip(prompts, outs))
        return outs
    monkeypatch.setattr(HFEngine, "generate_batch", generate_batch)
    cfg, plugins = load(toy_recipe(
        tmp_path, caller_dir, sampling={"max_new_tokens": 32},
        rollout={"groups_per_step": 1, "group_size": 4},
        trainer={"steps": 2, "micro_batch_size": 8},
        agent={"name": "chat", "args": {"agent": "verifiers", "agent_args": {
            "env": ENV_ID, "env_args": {"kind": "tool", "num_examples": 1}}}}), [])
    (tmp_path / "run").mkdir()
    history = train(cfg, plugins, tmp_path / "run", progress=False)
    # none dropped: a malformed tool call (2 of the 8 here) is scored as text, as verifiers would
    assert len(history) == 2 and all(h["rollout/trajectories"] == 4 for h in history)
    tok = AutoTokenizer.from_pretrained(caller_dir)
    called = 0
    for path in sorted((tmp_path / "run" / "trajectories").glob("*.parquet")):
        for r in pq.read_table(path).to_pylist():
            info = json.loads(r["info"])
            turns = check_token_exact(r["token_ids"], r["loss_mask"], r["behavior_logprobs"],
                                      calls)
            assert turns == info["verifiers/num_turns"] == info["chat_generations"]
            assert r["reward"] == info["verifiers/correct_answer"]     # the rubric's score
            if info["verifiers/add_calls"]:
                called += 1
                masked = [t for t, m in zip(r["token_ids"], r["loss_mask"]) if not m]
                sampled = [t for t, m in zip(r["token_ids"], r["loss_mask"]) if m]
                assert "<tool_response>\n4\n</tool_response>" in tok.decode(masked)
                assert CALL in tok.decode(sampled)
    assert called >= 1


def test_an_unknown_env_is_one_clear_error_before_anything_starts(tiny_model_dir, tmp_path):
    recipe = toy_recipe(tmp_path, tiny_model_dir, agent={"name": "chat", "args": {
        "agent": "verifiers", "agent_args": {"env": "no-such-env"}}})
    with pytest.raises(ConfigError, match=r"agent.args.agent_args.env 'no-such-env': ValueError: "
                                          r"Could not import 'no-such-env' environment"):
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
