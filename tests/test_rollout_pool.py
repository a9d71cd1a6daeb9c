"""Rollout defects seen on real runs, each checked on the real streaming pool and engine: DAPO's
refill asking for more groups than the pool holds, the async staleness default, abandoned
requests (pool cancellation, agent and engine timeouts) that kept decoding on the engine, and
sampling the trainer cannot reproduce."""

from __future__ import annotations

import asyncio

import pytest
import ray
from transformers import AutoTokenizer

from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.engines.hf import HFEngine
from molt_core.rollout.generator import Generator
from molt_core.rollout.pool import PooledGenerator
from molt_core.trainer import train
from molt_core.trajectory import Trajectory
from molt_rollout_async import AsyncScheme
from molt_rollout_partial import PartialScheme

ENV = "agent.args.env=next_letter"


class Inline:
    """An in-process HFEngine exposed with Ray's `.remote` calling convention."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        return type("M", (), {"remote": staticmethod(getattr(self.engine, name))})


class Agent:
    """One generate per rollout (no stop token: each runs to max_new_tokens). Reward: the
    rollout index in groups whose id is a multiple of `vary_every`, else 0 (a flat group)."""

    def __init__(self, tok, vary_every: int = 1) -> None:
        self.tok, self.vary_every = tok, vary_every

    async def rollout(self, ctx) -> Trajectory:
        prompt = self.tok("after c", add_special_tokens=False).input_ids
        t = Trajectory()
        t.add_prompt(prompt)
        t.add_completion(await ctx.generate(prompt, {**ctx.sampling, "stop_token_ids": []}))
        t.reward = float(ctx.rollout_id) if ctx.group_id % self.vary_every == 0 else 0.0
        return t


@pytest.mark.parametrize("scheme", ["sync", "async", "partial"])
def test_dapo_refills_more_groups_than_the_pool_holds(tiny_model_dir, scheme):
    """1 group in 4 has a reward spread, so DAPO asks `refill` for up to 4x the missing groups:
    more than the pool of 2 holds (async/partial took them in one `take` and raised)."""
    path = str(tiny_model_dir)
    cfg, plugins = load(None, [f"model.path={path}", ENV, f"rollout.scheme={scheme}",
                               "algorithm.correction=tis", "rollout.groups_per_step=2",
                               "rollout.group_size=2", "sampling.max_new_tokens=2"], ["dapo"])
    tok = AutoTokenizer.from_pretrained(path)
    gen = PooledGenerator(Agent(tok, vary_every=4), [Inline(HFEngine(path, seed=1))], cfg, tok,
                          len(tok))
    try:
        if scheme == "sync":
            groups, refill = gen.generate(2), gen.generate
        else:
            s = {"async": AsyncScheme, "partial": PartialScheme}[scheme](cfg, gen, None, [])
            groups, refill = s.next_batch(0), s.refill
        [out] = [r for r in plugins.hook.molt_filter_batch(groups=groups, step=0, refill=refill)
                 if r is not None]
        assert len(out) == 2
        assert all(g[0].group_id % 4 == 0 and len({t.reward for t in g}) == 2 for g in out)
        metrics: dict = {}
        plugins.hook.molt_on_step_end(step=0, metrics=metrics)
        assert metrics["dapo/groups_generated"] >= 6 and metrics["dapo/refill_rounds"] >= 2
    finally:
        gen.close()


def test_async_staleness_default_and_zero(tiny_model_dir):
    base = [f"model.path={tiny_model_dir}", ENV, "algorithm.correction=tis",
            "rollout.groups_per_step=4"]
    for scheme in ("async", "partial"):
        cfg, _ = load(None, base + [f"rollout.scheme={scheme}"])
        assert cfg.rollout.max_staleness == 1              # the pool is one batch deep
        cfg, _ = load(None, base + [f"rollout.scheme={scheme}", "rollout.max_inflight_groups=10"])
        assert cfg.rollout.max_staleness == 3              # ceil(10 / 4)
        with pytest.raises(ConfigError, match="rollout.max_staleness=0 with rollout.scheme="):
            load(None, base + [f"rollout.scheme={scheme}", "rollout.max_staleness=0"])
    assert load(None, base + ["rollout.max_staleness=0"])[0].rollout.max_staleness == 0  # sync


def test_async_default_keeps_the_pooled_groups(ray_local, tiny_chars_dir, tmp_path):
    """The CPU recipe under `async` with max_staleness unset: the groups the pool generated while
    the trainer stepped are trained (one version old), none dropped as stale."""
    cfg, plugins = load("recipes/cpu/next_letter.yaml",
                        [f"model.path={tiny_chars_dir}", "rollout.scheme=async",
                         "algorithm.correction=tis", "trainer.steps=6",
                         "rollout.groups_per_step=4", "check.consistency_every=0"])
    history = train(cfg, plugins, tmp_path, progress=False)
    assert history[-1].get("rollout/dropped/stale_group", 0) == 0
    assert sum(h.get("rollout/version_lag/1", 0) > 0 for h in history) >= 3


@pytest.mark.parametrize("key, value", [("repetition_penalty", 1.2), ("top_k", 5),
                                        ("top_p", 0.9), ("min_p", 0.05)])
@pytest.mark.parametrize("scheme", ["sync", "async"])
def test_sampling_the_trainer_cannot_reproduce_is_rejected(tiny_model_dir, key, value, scheme):
    with pytest.raises(ConfigError, match=f"sampling.{key}={value}: the trainer cannot reproduce"):
        load(None, [f"model.path={tiny_model_dir}", ENV, f"sampling.{key}={value}",
                    f"rollout.scheme={scheme}", "algorithm.correction=tis"])


@pytest.mark.timeout(600)       # a hang guard only: the waits below are on engine counters
def test_cancelled_requests_stop_decoding_on_the_engine(ray_local, tiny_model_dir):
    """Pool cancellation (as at shutdown; an agent or engine timeout takes the same path) aborts
    the requests on the engine: counted in decode steps and tokens, they stop where they were."""
    path = str(tiny_model_dir)
    cfg = load(None, [f"model.path={path}", ENV, "rollout.group_size=2",
                      "sampling.max_new_tokens=480"])[0]
    tok = AutoTokenizer.from_pretrained(path)
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=0)
    gen = PooledGenerator(Agent(tok), [engine], cfg, tok, len(tok))
    try:
        gen.start_pool(2)                                    # 4 requests of 480 tokens
        while ray.get(engine.stats.remote())["tokens_generated"] < 4:
            pass
        ray.get(engine.pause.remote())                       # hold them mid-response
        before = ray.get(engine.stats.remote())
        gen.submit(gen._cancel_all()).result(timeout=120)    # the pool gives up on them
        ray.get(engine.resume.remote())
        prompt = tok("after c", add_special_tokens=False).input_ids
        fresh = ray.get(engine.generate.remote(prompt, {**cfg.sampling.__dict__,
                                                        "max_new_tokens": 3,
                                                        "stop_token_ids": []}))
        after = ray.get(engine.stats.remote())               # the fresh request ran after them
        assert len(fresh.token_ids) == 3
        assert after["tokens_generated"] == before["tokens_generated"] + 3
        assert after["decode_steps"] <= before["decode_steps"] + 1 + 2
        assert before["tokens_generated"] < 4 * 480
    finally:
        gen.close()
        ray.kill(engine)


@pytest.mark.timeout(600)       # a hang guard only: the engine is paused, so the timeouts fire
def test_timed_out_requests_are_aborted_on_the_engine(ray_local, tiny_model_dir):
    """agent.timeout_s (the rollout's task is cancelled) and engine.timeout_s (the generate RPC
    is given up): the engine drops those requests, it does not decode them once it resumes."""
    path = str(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=0)
    prompt = tok("after c", add_special_tokens=False).input_ids

    async def give_up(gen: Generator):
        out = await gen.run_group(0)
        while gen.client.active:                 # the cancelled rollouts are still unwinding
            await asyncio.sleep(0.01)
        await asyncio.gather(*gen.client.aborts, return_exceptions=True)
        return out

    try:
        for kind, reason in (("agent", "agent_timeout"), ("engine", "agent_error")):
            cfg = load(None, [f"model.path={path}", ENV, "rollout.group_size=2",
                              "sampling.max_new_tokens=480", f"{kind}.timeout_s=3"])[0]
            gen = Generator(Agent(tok), [engine], cfg, tok, len(tok))
            try:
                ray.get(engine.pause.remote())           # nothing decodes: the timeout fires
                before = ray.get(engine.stats.remote())
                assert gen.submit(give_up(gen)).result(timeout=300) is None
                assert gen.counters[f"rollout/dropped/{reason}"] >= 1, gen.counters
                held = ray.get(engine.stats.remote())
                assert held["batches"] >= before["batches"] + 1     # the engine had them
                ray.get(engine.resume.remote())
                fresh = ray.get(engine.generate.remote(prompt, {**cfg.sampling.__dict__,
                                                                "max_new_tokens": 3,
                                                                "stop_token_ids": []}))
                after = ray.get(engine.stats.remote())   # the fresh request ran after them
                assert len(fresh.token_ids) == 3
                assert after["tokens_generated"] == before["tokens_generated"] + 3, kind
            finally:
                gen.close()
    finally:
        ray.kill(engine)
