"""Trainer backend `automodel` (NeMo AutoModel asserts CUDA when it builds a model): GPU only.

On CPU: the backend is registered, and its guard names the fix. On a GPU with nemo-automodel: the
same step as `fsdp2` gives the same log-probs, and the step changes the weights."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from molt_core.policy.automodel import AUTOMODEL_MISSING, AutoModelPolicy
from molt_core.config import TrainerConfig
from molt_core.plugins import build_plugins

HAVE_AUTOMODEL = importlib.util.find_spec("nemo_automodel") is not None
needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_AUTOMODEL),
    reason="backend automodel needs a CUDA GPU and nemo-automodel (AutoModel asserts CUDA)")


def test_registered_and_guarded():
    assert build_plugins().get("trainer_backend", "automodel") is AutoModelPolicy
    if not HAVE_AUTOMODEL:
        with pytest.raises(RuntimeError, match="pip install nemo-automodel"):
            AutoModelPolicy("unused", TrainerConfig())
    assert "trainer.backend=fsdp2" in AUTOMODEL_MISSING


@pytest.mark.gpu
@needs_gpu
def test_automodel_matches_fsdp2_and_trains(ray_local, tiny_model_dir):
    from molt_core.policy.handle import Policy
    from molt_core.policy.objective import TrainStep
    from molt_grpo import ppo_clip_loss

    path, cfg = str(tiny_model_dir), dataclasses.replace(TrainerConfig(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    B, T = 4, 16
    batch = {"input_ids": torch.randint(1, 500, (B, T), generator=g),
             "attention_mask": torch.ones(B, T, dtype=torch.bool),
             "loss_mask": torch.zeros(B, T, dtype=torch.bool),
             "advantages": torch.randn(B, 1, generator=g).expand(B, T).contiguous(),
             "versions": torch.zeros(B, T, dtype=torch.long)}
    batch["loss_mask"][:, 5:] = True
    opts = {"num_cpus": 0, "num_gpus": 0.5}
    am = AutoModelPolicy(path, cfg, actor_options=opts)
    ref = Policy(path, cfg, actor_options=opts)
    try:
        lp = am.logprobs(batch)
        assert (lp - ref.logprobs(batch)).abs().max() < 1e-3        # fp32, same weights
        batch["behavior_logprobs"] = lp
        before = am.full_params()
        metrics = am.train(batch, TrainStep(ppo_clip_loss, {}, "token-mean", 1.0))
        after = am.full_params()
        assert set(before) == set(ref.full_params())                # HF names, for the engines
        assert metrics["grad_norm"] > 0 and metrics["mismatch/max_abs"] < 1e-3
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        am.shutdown()
        ref.shutdown()
