"""The vertical slice end to end with real parts: HF engine + FSDP2 trainer as Ray actors, the gym
runner, weight sync, and the forward-consistency invariant."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray
import torch
from transformers import AutoTokenizer

from molt_core.cli import load
from molt_core.config import TrainerConfig
from molt_core.engines.hf import HFEngine
from molt_core.contracts import RolloutContext
from molt_core.plugins import build_plugins
from molt_core.policy.handle import Policy
from molt_core.consistency import ForwardConsistencyError, check_consistency
from molt_core.policy.objective import TrainStep
from molt_grpo import ppo_clip_loss

import common

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_new_tokens": 6}


def sample_batch(engine, tok, n: int = 12):
    """Sample n completions from the engine actor and collate them with random advantages."""
    prompts = [tok(f"after {c}", add_special_tokens=False).input_ids for c in "abcdefghijkl"[:n]]
    return common.sample_batch(engine, prompts, SAMPLING, torch.randn(n))[1:]


def test_engine_matches_trainer_after_weight_sync(ray_local, tiny_model_dir):
    path = str(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=3)
    policy = Policy(path, dataclasses.replace(TrainerConfig(), num_ranks=2, lr=1e-2), seed=0)
    try:
        _, batch = sample_batch(engine, tok)
        metrics = policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))
        assert metrics["mismatch/max_abs"] < 1e-4           # version 0 on both sides
        # the update really changed the model: its loss on the same batch went down
        lp, mask = policy.logprobs(batch), batch["loss_mask"]
        after, _ = ppo_clip_loss(lp, batch["behavior_logprobs"], batch["advantages"], mask)
        assert after[mask].mean().item() < metrics["loss"] - 1e-3, (after[mask].mean(), metrics)
        policy.push_weights([engine], 1)
        trajs, batch = sample_batch(engine, tok)
        assert {v for t in trajs for v, m in zip(t.versions, t.loss_mask) if m} == {1}
        trainer_lp = policy.logprobs(batch)
        gap = (trainer_lp - batch["behavior_logprobs"]).abs()[batch["loss_mask"]]
        assert gap.max().item() < 1e-4, gap.max()
        # a trainer at another temperature than the engine breaks invariant 3, loudly
        wrong = policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 0.5))
        cfg = load(None, [f"model.path={path}", "agent.args.env=next_letter"])[0]
        with pytest.raises(ForwardConsistencyError, match="sampling parameters"):
            check_consistency(cfg, 0, wrong)
    finally:
        policy.shutdown()
        ray.kill(engine)


def test_multi_turn_gym_rollout_is_token_exact(tiny_model_dir):
    """Env feedback is masked; trainable tokens are exactly the engine's sampled ids; the whole
    sequence decodes to the chat-template rendering of the conversation."""
    path = str(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(path, seed=5)
    sampled: list[list[int]] = []

    async def generate(ids, sampling=None, images=None):
        c = await engine.generate(ids, {**SAMPLING, "max_new_tokens": 3})
        sampled.append(list(c.token_ids))
        return c

    plugins = build_plugins()
    agent = plugins.get("agent", "gym")(None, tok, plugins, env="guess_number", max_turns=3)

    class AlwaysContinue(plugins.get("env", "guess_number")):
        async def step(self, action):       # random replies are rarely digits: keep talking
            return "higher", 0.25, False, {}
    agent.env_cls = AlwaysContinue
    ctx = RolloutContext(0, 0, 11, SAMPLING, generate, tok)
    traj = asyncio.run(agent.rollout(ctx))
    traj.check(len(tok))
    assert len(sampled) == 3 and traj.turn_rewards == [0.25] * 3
    trainable = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert trainable == [t for s in sampled for t in s]
    # masked tokens between the turns spell the template's text for the env's reply
    spans, cur = [], []
    for t, m in zip(traj.token_ids, traj.loss_mask):
        if m and cur:
            spans.append(cur)
            cur = []
        elif not m:
            cur.append(t)
    assert "<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n" in tok.decode(spans[1])
    assert all(v == 0 for v, m in zip(traj.versions, traj.loss_mask) if m)
