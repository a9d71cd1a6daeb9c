"""Parallelism as configuration: sizes, backend, model and engine combinations that cannot run are
rejected before anything starts; the Ray resource check; optimizer offload is wired; the GPU
recipes load and validate on CPU."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import ray
import torch
import yaml

from molt_core.run import cluster
from molt_core.cli import check_against_plugins
from molt_core.config import Config, ConfigError, TrainerConfig, load_config
from molt_core.config_rules import model_facts
from molt_core.plugins import build_plugins

RECIPE = "recipes/cpu/next_letter.yaml"
# Qwen3-30B-A3B's config.json, the fields validation reads (the checkpoint is not needed here).
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                 "num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 2048,
                 "num_hidden_layers": 48, "vocab_size": 151936}


def _model_dir(root: Path, name: str, tiny: Path, **extra) -> str:
    """A copy of the tiny model's config.json with `extra` fields (validation reads only it)."""
    d = root / name
    d.mkdir()
    config = {**json.loads((tiny / "config.json").read_text()), **extra}
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.fixture
def dirs(tmp_path, tiny_model_dir):
    return {"dense": str(tiny_model_dir),
            "moe": _model_dir(tmp_path, "moe", tiny_model_dir, num_experts=4),
            "mtp": _model_dir(tmp_path, "mtp", tiny_model_dir, mtp_num_hidden_layers=1)}


AM = ["trainer.backend=automodel"]


@pytest.mark.parametrize("model, overrides, message", [
    ("dense", AM + ["trainer.num_ranks=3", "trainer.tp_size=2"],
     "trainer.num_ranks=3 is not dp_size*tp_size*cp_size"),
    ("dense", AM + ["trainer.num_ranks=4", "trainer.dp_size=2"],
     "trainer.num_ranks=4 is not dp_size*tp_size*cp_size = 2*1*1"),
    ("dense", ["trainer.num_ranks=2", "trainer.tp_size=2"],
     "trainer.backend=fsdp2 shards parameters over data-parallel ranks only"),
    ("moe", ["trainer.num_ranks=2", "trainer.ep_size=2", "trainer.moe_routing=off"],
     "need trainer.backend=automodel"),
    ("dense", AM + ["trainer.num_ranks=2", "trainer.cp_size=2"],
     "context parallelism is not supported"),
    ("dense", AM + ["trainer.num_ranks=2", "trainer.ep_size=2", "trainer.moe_routing=off"],
     "trainer.ep_size=2 on a dense model"),
    ("moe", AM + ["trainer.num_ranks=3", "trainer.ep_size=3", "trainer.moe_routing=off"],
     "must divide the model's num_experts (4)"),
    ("moe", AM + ["trainer.num_ranks=2", "trainer.ep_size=2"],
     "set trainer.moe_routing=off"),
    ("moe", AM + ["trainer.num_ranks=2", "trainer.ep_size=2", "trainer.moe_routing=off",
                  "trainer.moe_aux_loss_coef=0.01"], "set trainer.moe_aux_loss_coef=0"),
    ("dense", ["engine.tensor_parallel_size=2"], "need engine.name=vllm"),
    ("dense", ["engine.speculative={method: ngram, num_speculative_tokens: 2}"],
     "need engine.name=vllm"),
    ("dense", ["engine.name=vllm", "engine.speculative={method: mtp, num_speculative_tokens: 1}"],
     "needs a model with an MTP head"),
    ("dense", ["trainer.tp_size=0"], "must be >= 1"),
])
def test_impossible_parallelism_is_rejected_with_the_reason(dirs, model, overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, [f"model.path={dirs[model]}", *overrides])
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("model, overrides", [
    ("moe", AM + ["trainer.num_ranks=4", "trainer.ep_size=4", "trainer.moe_routing=off"]),
    ("dense", AM + ["trainer.num_ranks=8", "trainer.tp_size=2"]),          # dp inferred: 4
    ("dense", AM + ["trainer.num_ranks=8", "trainer.tp_size=2", "trainer.dp_size=4"]),
    ("mtp", ["engine.name=vllm", "engine.tensor_parallel_size=2",
             "engine.speculative={method: mtp, num_speculative_tokens: 1}"]),
    ("dense", ["trainer.optimizer_offload=true"]),
])
def test_possible_parallelism_is_accepted(dirs, model, overrides):
    load_config(RECIPE, [f"model.path={dirs[model]}", *overrides])


def test_engine_options_reach_the_engine_constructor(dirs):
    cfg = load_config(RECIPE, [
        f"model.path={dirs['mtp']}", "engine.name=vllm", "engine.tensor_parallel_size=2",
        "engine.speculative={method: mtp, num_speculative_tokens: 1}", "seed=3",
        "engine.args={gpu_memory_utilization: 0.3, engine_kwargs: {max_num_batched_tokens: 64}}"])
    assert cluster.engine_kwargs(cfg, 1) == {
        "dtype": "float32", "max_batch_size": 256, "seed": 1003, "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.3,
        "engine_kwargs": {"max_num_batched_tokens": 64,
                          "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}}
    with pytest.raises(ConfigError, match="engine.args sets \\['seed'\\]"):
        load_config(RECIPE, [f"model.path={dirs['dense']}", "engine.args={seed: 1}"])


def test_model_facts(tmp_path, tiny_model_dir):
    vl = _model_dir(tmp_path, "vl", tiny_model_dir, text_config={"num_experts": 8})
    assert model_facts(vl) == {"num_experts": 8, "mtp_layers": 0}
    assert model_facts(str(tiny_model_dir)) == {"num_experts": 0, "mtp_layers": 0}


def _cfg(**trainer) -> Config:
    cfg = Config()
    cfg.trainer = dataclasses.replace(TrainerConfig(), **trainer)
    return cfg


def test_actor_options_follow_the_config():
    cfg = _cfg(num_ranks=2, resources={"molt_trainer": 1})
    cfg.engine = dataclasses.replace(cfg.engine, tensor_parallel_size=2, cpus_per_engine=1.0)
    rank, engine = cluster.actor_options(cfg, has_gpus=True)
    assert rank == {"num_cpus": 0.0, "num_gpus": 1.0, "resources": {"molt_trainer": 1}}
    assert engine == {"num_cpus": 1.0, "num_gpus": 2.0, "resources": {}}
    rank, engine = cluster.actor_options(cfg, has_gpus=False)
    assert (rank["num_gpus"], engine["num_gpus"]) == (0.0, 0.0)


@pytest.mark.parametrize("trainer, engine, nodes, message", [
    # 8 + 8 GPUs on one 8-GPU node: the totals do not fit
    ({"num_ranks": 8}, {"num_engines": 8}, [{"CPU": 64, "GPU": 8}],
     "the run needs 16 GPU (8 trainer ranks x 1 + 8 engines x 1) but the Ray cluster has 8"),
    # an engine with tensor_parallel_size 8 on 4-GPU nodes: no single node can hold it
    ({"num_ranks": 1}, {"num_engines": 1, "tensor_parallel_size": 8},
     [{"CPU": 8, "GPU": 4}, {"CPU": 8, "GPU": 4}], "one engine needs {'GPU': 8.0}"),
    # placement resources that no node offers
    ({"num_ranks": 2, "resources": {"molt_trainer": 1}}, {}, [{"CPU": 8, "GPU": 4}],
     "one trainer rank needs {'GPU': 1.0, 'molt_trainer': 1.0}"),
    ({"num_ranks": 4, "cpus_per_rank": 1.0}, {}, [{"CPU": 2}],
     "the run needs 4 CPU (4 trainer ranks x 1) but the Ray cluster has 2"),
])
def test_resource_check_names_what_does_not_fit(trainer, engine, nodes, message):
    cfg = _cfg(**trainer)
    cfg.engine = dataclasses.replace(cfg.engine, **engine)
    rank, eng = cluster.actor_options(cfg, any(n.get("GPU") for n in nodes))
    with pytest.raises(ConfigError) as e:
        cluster.check_resources(cfg, rank, eng, nodes)
    assert message in str(e.value), str(e.value)


def test_resource_check_accepts_the_seed_protocol():
    cfg = _cfg(num_ranks=8, resources={"molt_trainer": 1})
    cfg.engine = dataclasses.replace(cfg.engine, num_engines=8, resources={"molt_engine": 1})
    nodes = [{"CPU": 128, "GPU": 8, "molt_trainer": 8}, {"CPU": 128, "GPU": 8, "molt_engine": 8}]
    cluster.check_resources(cfg, *cluster.actor_options(cfg, True), nodes)


def test_oversized_run_fails_before_any_actor_starts(ray_local, tiny_model_dir):
    cfg = load_config(RECIPE, [f"model.path={tiny_model_dir}", "trainer.num_ranks=2",
                               "trainer.cpus_per_rank=2"])
    with pytest.raises(ConfigError, match="needs 4 CPU .* the Ray cluster has 2"):
        with cluster.start(cfg, build_plugins()):
            pass
    names = [a.get("name", "") for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not any(n.startswith("molt-") for n in names)


def test_optimizer_offload_is_wired_and_trains(ray_local, tiny_model_dir):
    """On CPU FSDP2's CPUOffloadPolicy moves nothing, but it is the policy the ranks run with."""
    from molt_core.policy.handle import Policy
    from molt_core.policy.objective import TrainStep
    from molt_grpo import ppo_clip_loss

    path = str(tiny_model_dir)
    policy = Policy(path, dataclasses.replace(TrainerConfig(), num_ranks=1, optimizer_offload=True,
                                              in_driver=False))     # an actor, to ask its rank
    try:
        kind = ray.get(policy.workers[0].__ray_call__.remote(
            lambda w: type(w.model.model.layers[0]._get_fsdp_state()
                           ._fsdp_param_group.offload_policy).__name__), timeout=60)
        assert kind == "CPUOffloadPolicy"
        batch = _batch()
        before = policy.full_params()
        metrics = policy.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))
        after = policy.full_params()
        assert metrics["grad_norm"] > 0
        assert any(not (before[k] == after[k]).all() for k in before)
    finally:
        policy.shutdown()


def _batch(B: int = 4, T: int = 12) -> dict:
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1, 500, (B, T), generator=g),
             "attention_mask": torch.ones(B, T, dtype=torch.bool),
             "loss_mask": torch.zeros(B, T, dtype=torch.bool),
             "advantages": torch.randn(B, 1, generator=g).expand(B, T).contiguous(),
             "versions": torch.zeros(B, T, dtype=torch.long)}
    batch["loss_mask"][:, 4:] = True
    batch["behavior_logprobs"] = torch.full((B, T), -6.0) * batch["loss_mask"]
    return batch


@pytest.mark.parametrize("recipe", ["recipes/gpu/dapo-math-qwen3-30b-a3b.yaml",
                                    "recipes/gpu/smoke-qwen3.yaml"])
def test_gpu_recipes_load_and_validate(recipe, tmp_path, tiny_model_dir):
    """Config validation and plugin cross-checks of the GPU recipes; the GPU-only checks (vllm and
    nemo-automodel installed, the Ray cluster's GPUs) are not run here."""
    data = yaml.safe_load(open(recipe))
    model = (_model_dir(tmp_path, "qwen3-30b-a3b", tiny_model_dir, **QWEN3_30B_A3B)
             if "30b" in recipe else str(tiny_model_dir))
    data_file = tmp_path / "math.jsonl"
    data_file.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    overrides = [f"model.path={model}"]
    if data["agent"]["args"].get("env") == "math":
        overrides.append(f"agent.args.env_args.data={data_file}")
    plugins = build_plugins()
    cfg = load_config(recipe, overrides, plugins.registry["config_section"])
    check_against_plugins(cfg, plugins)
    assert (cfg.trainer.backend, cfg.engine.name) == ("automodel", "vllm")
    if "30b" in recipe:
        t, e = cfg.trainer, cfg.engine
        assert t.num_ranks * 1 == 8 and e.num_engines * e.tensor_parallel_size == 8
        assert cfg.rollout.scheme == "async" and cfg.algorithm.estimator == "dapo"
    shutil.rmtree(tmp_path / "qwen3-30b-a3b", ignore_errors=True)


def test_threads_follow_reserved_cpus_and_the_scheme():
    cfg = _cfg(num_ranks=1)
    assert cluster.num_threads(cfg, 2) == (2, 2)       # sync: each phase gets the whole node
    cfg.rollout = dataclasses.replace(cfg.rollout, scheme="async")
    assert cluster.num_threads(cfg, 2) == (1, 1)       # overlapping: the node is split
    assert cluster.num_threads(cfg, 8) == (4, 4)
    cfg.trainer = dataclasses.replace(cfg.trainer, cpus_per_rank=3.0, num_ranks=2)
    cfg.engine = dataclasses.replace(cfg.engine, cpus_per_engine=0.5)
    assert cluster.num_threads(cfg, 2) == (3, 1)       # reserved CPUs win
