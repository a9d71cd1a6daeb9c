"""The tool-using SmolLM2 agent (issue 26): examples/calculator_agent.py on the stock OpenAI SDK,
the tool-aware template recipes/templates/smollm2_tools.jinja, recipes/cpu/smollm2_agent.yaml.

The first test drives the agent through the real chat server, SDK and SmolLM2 tokenizer with a
scripted engine (replies fixed, so the tool is certainly called); the second runs two real
training steps of the recipe with forward consistency checked and the held-out evaluation."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from molt_core.chat.server import ChatServer
from molt_core.cli import load
from molt_core.multimodal import load_tokenizer
from molt_core.trainer import train
from molt_core.trajectory import Completion

ROOT = Path(__file__).parents[1]
RECIPE = str(ROOT / "recipes/cpu/smollm2_agent.yaml")
PLUGIN = str(ROOT / "examples/calculator_agent.py")
TEMPLATE = str(ROOT / "recipes/templates/smollm2_tools.jinja")


@pytest.fixture(scope="module")
def agent_module():
    sys.path.insert(0, str(ROOT / "examples"))
    import calculator_agent
    yield calculator_agent
    sys.path.remove(str(ROOT / "examples"))


def test_tool_turns_are_token_exact(smollm2_dir, agent_module):
    tok = load_tokenizer(str(smollm2_dir), TEMPLATE)
    agent = agent_module.CalculatorAgent(split="test")
    a, b = agent.problem(7)
    replies = [f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}'
               "</tool_call><|im_end|>", f"{a} * {b} = {a * b}<|im_end|>"]
    sampled, prompts = [], []

    async def generate(prompt_ids: list[int], sampling: dict) -> Completion:
        ids = tok.encode(replies[len(sampled)], add_special_tokens=False)
        sampled.append(ids)
        prompts.append(list(prompt_ids))
        return Completion(ids, [-0.5] * len(ids), [0] * len(ids))

    async def main():
        server = ChatServer()
        await server.start()
        s = server.open_session(tok, generate, {"temperature": 1.0, "max_new_tokens": 40},
                                max_context=2048)
        ctx = agent_module.ChatContext(7, 0, 0, s.base_url, s.anthropic_base_url, s.api_key)
        reward = await agent.run(ctx)
        traj = server.close_session(s)
        await server.close()
        return reward, ctx.info, traj

    reward, info, traj = asyncio.run(main())
    assert reward == 1.0 and info["tool_calls"] == 1 and info["tool_correct"] == 1.0
    assert traj.segments == [0]          # the re-rendered history extends what was sampled
    trainable = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert trainable == sampled[0] + sampled[1]
    assert traj.token_ids[:len(prompts[1])] == prompts[1]    # turn 2 saw turn 1 as sampled
    text = tok.decode(traj.token_ids, skip_special_tokens=False)
    assert "- calculator(expression): " in text
    assert f"<tool_response>{a * b}</tool_response>" in text


def test_tool_template_without_tools_is_smollm2s(smollm2_dir):
    own, tools = load_tokenizer(str(smollm2_dir)), load_tokenizer(str(smollm2_dir), TEMPLATE)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert tools.apply_chat_template(msgs, tokenize=False) == \
        own.apply_chat_template(msgs, tokenize=False)
    with pytest.raises(FileNotFoundError, match="model.chat_template 'nope.jinja'"):
        load_tokenizer(str(smollm2_dir), "nope.jinja")


def test_smollm2_agent_smoke(ray_local, smollm2_dir):
    cfg, plugins = load(RECIPE, [
        f"model.path={smollm2_dir}", f"model.chat_template={TEMPLATE}", "trainer.steps=2",
        "rollout.groups_per_step=1", "rollout.group_size=2", "sampling.max_new_tokens=16",
        "agent.args.agent_args.max_turns=2", "eval.every=2", "eval.prompts=2",
        "check.consistency_every=1", "check.consistency_tol=0.001"], [PLUGIN])
    history = train(cfg, plugins, None, progress=False)
    steps = [h for h in history if "reward/mean" in h]
    evals = [h for h in history if "eval/time_s" in h]
    assert len(steps) == 2 and [e["step"] for e in evals] == [0, 2]
    for h in steps:      # the check raised above 1e-3
        assert h["mismatch/max_abs"] < 1e-3 and h["response/len_mean"] > 1
    assert all(0 <= e["eval/greedy/pass@1"] <= 1 for e in evals)
