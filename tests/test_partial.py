"""Partial rollout against real Ray actors (HF engine + FSDP2 trainer), and the CPU recipe
learning under the async and partial schemes. (Ray-using tests live after test_config, which
checks that a bad config starts no Ray.)"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from molt_core.cli import load
from molt_core.config import TrainerConfig
from molt_core.engines.hf import HFEngine
from molt_core.rollout.pool import PooledGenerator
from molt_core.rollout.restarts import EngineRestarts
from molt_core.policy.logprobs import token_logprobs
from molt_core.policy.handle import Policy
from molt_core.policy.objective import TrainStep
from molt_core.consistency import probe_consistency
from molt_core.trainer import train
from molt_core.trajectory import Trajectory, collate
from molt_grpo import ppo_clip_loss
from molt_rollout_partial import PartialScheme


class Inline:
    """An in-process HFEngine exposed with Ray's `.remote` calling convention."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        fn = getattr(self.engine, name)
        return type("M", (), {"remote": staticmethod(fn)})


class CountingAgent:
    """Generates one response per rollout (no stop token: every response runs to the length
    limit) and records each completion exactly as the engine returned it."""

    def __init__(self, tok, fail_every: int = 0) -> None:
        self.tok, self.fail_every = tok, fail_every
        self.calls, self.completions = 0, {}

    async def rollout(self, ctx) -> Trajectory:
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError("flaky agent")
        prompt = self.tok("after c", add_special_tokens=False).input_ids
        c = await ctx.generate(prompt, {**ctx.sampling, "stop_token_ids": []})
        self.completions[(ctx.group_id, ctx.rollout_id)] = (list(c.token_ids), list(c.logprobs),
                                                            list(c.versions))
        t = Trajectory()
        t.add_prompt(prompt)
        t.add_completion(c)
        t.reward = float(len(set(c.token_ids)))
        return t


def test_pool_streams_and_accounts_for_every_group(tiny_model_dir):
    """No Ray: an in-process engine behind the streaming pool, with an agent that fails 1 in 5."""
    path = str(tiny_model_dir)
    cfg = load(None, [f"model.path={path}", "agent.args.env=next_letter", "rollout.group_size=2",
                      "sampling.max_new_tokens=4"])[0]
    tok = AutoTokenizer.from_pretrained(path)
    agent = CountingAgent(tok, fail_every=5)
    gen = PooledGenerator(agent, [Inline(HFEngine(path, seed=1))], cfg, tok, len(tok))
    try:
        gen.start_pool(4)
        taken = gen.take(3) + gen.take(3)       # the second take needs groups started after the first
        assert len(taken) == 6 and all(len(g) == 2 for g in taken)
        assert gen.pool_state()["inflight"] + gen.pool_state()["buffered"] <= 4
        gen.stop_pool()
        c = gen.counters
        out = taken + gen.take(gen.pool_state()["buffered"])
        assert c["rollout/started_groups"] == len(out) + c["rollout/dropped/incomplete_group"]
        assert c["rollout/dropped/incomplete_group"] >= 1           # fail_every=5 dropped some
        # rollouts in = trajectories out + the rollouts of the counted incomplete groups
        assert agent.calls == 2 * c["rollout/started_groups"]
        assert agent.calls == sum(map(len, out)) + 2 * c["rollout/dropped/incomplete_group"]
        assert c["rollout/dropped/agent_error"] >= c["rollout/dropped/incomplete_group"]
    finally:
        gen.close()


@pytest.mark.timeout(900)      # a hang guard only: nothing here waits on a clock
def test_partial_rollout_switches_versions_inside_a_response(ray_local, tiny_model_dir):
    path = str(tiny_model_dir)
    cfg = load(None, [f"model.path={path}", "agent.args.env=next_letter", "rollout.scheme=partial",
                      "algorithm.correction=tis",
                      "rollout.groups_per_step=2", "rollout.group_size=2",
                      "rollout.max_inflight_groups=4", "rollout.max_staleness=1",
                      "sampling.max_new_tokens=480"])[0]
    tok = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=3)
    policy = Policy(path, TrainerConfig(num_ranks=1, lr=3e-2), seed=0)
    agent = CountingAgent(tok)
    gen = PooledGenerator(agent, [engine], cfg, tok, vocab)
    try:
        scheme = PartialScheme(cfg, gen, EngineRestarts(cfg, None, gen, policy), [engine])
        first = scheme.next_batch(0)                        # 4 groups ran in one wave; 2 taken
        assert {v for g in first for t in g for v in t.versions if v >= 0} == {0}
        # The first wave is 8 responses of exactly 480 tokens (no stop token); once the count
        # passes it the replacement groups are decoding: pause them there (a counter, not a
        # clock) so they are still mid-response when the trainer's weights arrive.
        while ray.get(engine.stats.remote())["tokens_generated"] <= 8 * 480:
            time.sleep(0.001)
        ray.get(engine.pause.remote())
        trajs = [t for g in first for t in g]
        batch = collate(trajs, [[1.0 if i % 2 else -1.0] * len(t) for i, t in enumerate(trajs)])
        policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0, "tis", {}, 0))
        assert scheme.sync_weights(0) == 1                  # pause, push, resume mid-response
        gen.stop_pool()
        rest = gen.take(gen.pool_state()["buffered"])
        out = first + rest
        spanning = [t for g in rest for t in g
                    if {v for v, m in zip(t.versions, t.loss_mask) if m} == {0, 1}]
        assert spanning, [sorted(set(t.versions)) for g in rest for t in g]
        # versions never go back within a response
        for t in spanning:
            v = [v for v, m in zip(t.versions, t.loss_mask) if m]
            assert v == sorted(v)
        # each token's behavior log-prob is what the engine reported when it sampled it ...
        for g in out:
            for t in g:
                ids, lps, vs = agent.completions[(t.group_id, t.rollout_id)]
                n = len(ids)
                assert t.token_ids[-n:] == ids and t.logprobs[-n:] == lps and t.versions[-n:] == vs
        # ... and that is the log-prob under the weights of its version (v0: the initial model,
        # v1: the trainer after its step), so the engine recomputed the cache after the switch
        b = collate(spanning, [[0.0] * len(t) for t in spanning])
        model0 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            lp0 = token_logprobs(model0, {k: b[k] for k in ("input_ids", "attention_mask",
                                                            "loss_mask")}, 1.0, 1024).logprobs
        lp1 = policy.logprobs(b)
        for lp, v in ((lp0, 0), (lp1, 1)):
            sel = b["loss_mask"] & (b["versions"] == v)
            assert (lp - b["behavior_logprobs"])[sel].abs().max() < 1e-4, v
        assert (lp1 - lp0)[b["loss_mask"]].abs().max() > 1e-3     # the weights did change
        # no request lost or restarted: requests in = trajectories out (+ counted drops: none)
        c = gen.counters
        assert c["rollout/started_groups"] == len(out) + c["rollout/dropped/incomplete_group"]
        assert c["rollout/dropped/incomplete_group"] == 0
        assert agent.calls == sum(map(len, out)) == ray.get(engine.stats.remote())["requests"]
        # forward-consistency probe on fresh tokens of the pushed weights (async batches may hold
        # none): engine and trainer agree; a trainer at another temperature shows the gap
        assert probe_consistency(gen, policy, 1, 1.0) < 1e-4
        assert probe_consistency(gen, policy, 1, 0.5) > 1e-2
        assert gen.counters["check/probe_groups"] == 2
    finally:
        gen.close()
        policy.shutdown()
        ray.kill(engine)


def learn(tiny_chars_dir, tmp_path, scheme: str, steps: int, *extra: str):
    """The multi-token CPU task (recipes/cpu/reverse.yaml) under an off-policy scheme."""
    cfg, plugins = load("recipes/cpu/reverse.yaml",
                        [f"model.path={tiny_chars_dir}", f"trainer.steps={steps}",
                         f"rollout.scheme={scheme}", "algorithm.correction=tis",
                         "log.trajectories_every=0", *extra])
    history = train(cfg, plugins, tmp_path, progress=False)
    start = sum(h["reward/mean"] for h in history[:5]) / 5
    end = sum(h["reward/mean"] for h in history[-20:]) / 20
    lag = max(h.get("rollout/version_lag_max", 0) for h in history)
    split = sum(h.get("rollout/multi_version", 0) * h["rollout/trajectories"] for h in history)
    print(f"{scheme}: mean reward first 5 steps {start:.3f}, last 20 steps {end:.3f}; "
          f"max version lag {lag}; {split:.0f} responses sampled by two versions; "
          f"{history[-1]['time/step_s']:.3f}s/step")
    return history, start, end, split


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["async", "partial"])
def test_multi_token_task_learns_off_policy(ray_local, tiny_chars_dir, tmp_path, scheme):
    # A small engine batch keeps the engine busy while the trainer steps, so partial rollout's
    # weight pushes land inside responses. Letters a-d: answering the prompt's letters in random
    # places scores 0.325, a plateau that off-policy runs leave only sometimes within 300 steps
    # (timing decides their batches). Measured (2026-12-01, 300 steps): async 0.552 (the same
    # each run), partial 0.56-0.77 in 6 of 7 runs and 0.315 in the other. With letters a-h
    # (plateau 0.21) partial ended at 0.38-0.57 or stayed near 0.2-0.3 in 4 of 12 runs, below
    # the old bound of 0.33.
    # Both run deterministic (rollout.deterministic): batch i sampled by version i - 2 (partial:
    # each response's last 2 tokens by i - 1), so the seed fixes the run. Sweeps (2026-12-02,
    # seeds 1-5): async 0.587, 0.692, 0.767, 0.447, 0.540; partial 0.705, 0.490, 0.719, 0.499,
    # 0.741.
    history, start, end, split = learn(tiny_chars_dir, tmp_path, scheme, 300,
                                       "engine.max_batch_size=32",
                                       "rollout.max_inflight_groups=32",
                                       "agent.args.env_args.letters=abcd",
                                       "rollout.deterministic=true")
    assert start <= 0.15
    assert end >= 0.25     # from ~0.06: the format and the prompt's letters are learnt
    assert all(h.get("rollout/version_lag_max", 0) <= 2 for h in history)   # ceil(32 / 16)
    assert any(h.get("rollout/version_lag_max", 0) >= 1 for h in history)    # it did overlap
    if scheme == "partial":
        assert split >= 1                  # some response carries two policy versions
    else:                   # async pushes at request boundaries: a response has one version
        assert split == 0
        assert history[-1].get("check/probe_groups", 0) >= 1
