"""Compaction inside the trajectory (`molt_chat.Compactor`, docs/agents.md): a rollout that
compacts once holds three linked segments (before, the summary call, after) whose trainable
tokens are exactly what the engine sampled and which all carry the rollout's reward; and a tiny
model learns a task whose answer depends on a fact stated before the compaction."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from transformers import AutoTokenizer

from molt_chat import ChatRunner, Compactor
from molt_core.advantage import training_batch
from molt_core.cli import load
from molt_core.config import AlgorithmConfig
from molt_core.contracts import RolloutContext
from molt_core.engines.hf import HFEngine
from molt_core.trainer import train
from molt_grpo import grpo_advantages

from compaction_agent import Recall


class Scored(Recall):
    """`recall` rewarded by rollout id (0, 1), so GRPO gives its segments a nonzero advantage."""

    async def run(self, ctx):
        await super().run(ctx)
        return float(ctx.rollout_id)


def test_a_compacted_rollout_is_three_linked_segments_trained_on_the_sampled_ids(tiny_chars_dir):
    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    engine, calls = HFEngine(str(tiny_chars_dir), seed=0), []

    async def generate(prompt_ids, sampling):
        c = await engine.generate(prompt_ids, sampling)
        calls.append((list(prompt_ids), c))
        return c
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "repetition_penalty": 1.0, "max_new_tokens": 8,
                "stop_token_ids": [tok.convert_tokens_to_ids("<|im_end|>")]}
    runner = ChatRunner(SimpleNamespace(model=SimpleNamespace(path=str(tiny_chars_dir))), tok,
                        SimpleNamespace(get=lambda kind, name: Scored), agent="scored")

    async def main():
        try:
            trajs = [await runner.rollout(RolloutContext(0, i, 7, sampling, generate, tok))
                     for i in range(2)]
            from molt_core.chat.server import shared_server   # a bad tag: one clear 400
            s = (await shared_server()).open_session(tok, generate, sampling, max_context=512)
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key,
                                          max_retries=0) as client:
                with pytest.raises(openai.BadRequestError, match="its molt_segment a string"):
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "a"}],
                        metadata={"molt_segment": 3})
            return trajs
        finally:
            await runner.aclose()
    trajs = asyncio.run(main())
    assert len(calls) == 6                                  # 3 model calls per rollout
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for t, (before, summary, after) in zip(trajs, (calls[:3], calls[3:])):
        assert len(t.segments) == 3 and t.info["segment_roles"] == ["", "summary", ""]
        assert [s.reward for s in t.split_segments()] == [t.reward] * 3   # the reward on each
        bounds = t.segments + [len(t)]
        for k, (prompt, c) in enumerate((before, summary, after)):
            # each segment: the engine's prompt (masked), then its sampled ids (trainable), as is
            a, b = bounds[k], bounds[k + 1]
            n = len(c.token_ids)
            assert t.token_ids[a:b] == prompt + c.token_ids and t.logprobs[b - n:b] == c.logprobs
            assert t.loss_mask[a:b] == [False] * len(prompt) + [True] * n
        assert t.turns() == [(bounds[k] + len(p), bounds[k + 1])
                             for k, (p, _) in enumerate((before, summary, after))]
        ids = summary[1].token_ids
        text = tok.decode(ids[:-1] if ids[-1] == eos else ids, skip_special_tokens=False)
        assert t.info["fact"] in tok.decode(summary[0]) and t.info["summary"] == text
        # the after segment starts from the summary alone: the fact reaches it only through it
        assert tok.decode(after[0]) == tok.apply_chat_template(
            [{"role": "user", "content": text}, {"role": "user", "content": "q"}], tokenize=False,
            add_generation_prompt=True)
    batch, _, _ = training_batch(trajs, grpo_advantages, AlgorithmConfig(), None, 1.0, 0)
    adv, mask = batch["advantages"], batch["loss_mask"]
    assert batch["rollout_index"].flatten().tolist() == [0, 0, 0, 1, 1, 1]
    for row, sign in zip(range(6), [-1] * 3 + [1] * 3):     # every segment gets its rollout's
        got = adv[row][mask[row]]
        assert (got * sign > 0).all() and len(set(got.tolist())) == 1


class _Client:
    """Records the summary request (what the helper sends, not how the server takes it)."""

    def __init__(self):
        self.sent = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **kw):
        self.sent.append(kw)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="S"))])


def test_the_compactor_keeps_the_system_prompt_recent_turns_and_tool_results_with_their_call():
    sys_, u = {"role": "system", "content": "sys"}, {"role": "user", "content": "u"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    tool, a = {"role": "tool", "content": "7", "tool_call_id": "1"}, {"role": "assistant",
                                                                       "content": "7"}
    history, client = [sys_, u, call, tool, a], _Client()
    assert asyncio.run(Compactor(max_messages=4)(client, "m", history)) is history
    assert asyncio.run(Compactor(max_tokens=9)(client, "m", history,
                                               SimpleNamespace(total_tokens=9))) is history
    out = asyncio.run(Compactor(max_messages=3, keep=2, prefix="P: ")(client, "m", history))
    assert out == [sys_, {"role": "user", "content": "P: S"}, call, tool, a]   # cut before the call
    (sent,) = client.sent
    assert sent["messages"][:-1] == [sys_, u] and sent["metadata"] == {"molt_segment": "summary"}
    out = asyncio.run(Compactor(max_tokens=9, keep=0)(client, "m", history,
                                                      SimpleNamespace(total_tokens=10)))
    assert out[0] == sys_ and len(out) == 2 and client.sent[-1]["messages"][:-1] == history
