"""Opt-in richer plugin inputs: estimators naming `rollouts` get per-rollout lengths, token counts
and info; losses naming `group_index`, `step`, `ref_logprobs` get them; `molt_core.testing`."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from molt_core.cli import load
from molt_core.testing import fake_groups, run_step

# A third-party plugin as an author writes it: a length-penalised GRPO advantage and a PPO-clip
# loss that reports what it was given (metrics come back from the trainer ranks).
PLUGIN = '''
import torch
from molt_core import hookimpl
from molt_core.advantage import Rollouts
from molt_core.algos import group_stats
from molt_grpo import ppo_clip_loss

MOLT_HOOK_API = ">=1,<2"


def short_grpo(rewards, group_index, *, rollouts: Rollouts, alpha: float = 0.2):
    """GRPO on reward - alpha * (extra sampled tokens beyond the first)."""
    r = rewards - alpha * (rollouts.lengths - 1).float()
    mean, std, _ = group_stats(r, group_index)
    return (r - mean) / (std + 1e-6)


def seen_loss(logprobs, behavior_logprobs, advantages, mask, *, group_index, step: int,
              ref_logprobs, clip: float = 0.2):
    loss, metrics = ppo_clip_loss(logprobs, behavior_logprobs, advantages, mask, clip_low=clip,
                                  clip_high=clip)
    return loss, {**metrics, "seen/step": torch.tensor(float(step)),
                  "seen/groups": torch.tensor(float(group_index.unique().numel())),
                  "seen/ref_gap": (logprobs - ref_logprobs).detach().abs()}


@hookimpl
def molt_estimators():
    return {"short_grpo": short_grpo}


@hookimpl
def molt_losses():
    return {"seen_loss": seen_loss}
'''


@pytest.fixture
def lenpen(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "molt_test_lenpen.py").write_text(textwrap.dedent(PLUGIN))
    import ray.cloudpickle

    import molt_test_lenpen
    ray.cloudpickle.register_pickle_by_value(molt_test_lenpen)   # Ray workers lack tmp_path
    yield molt_test_lenpen
    ray.cloudpickle.unregister_pickle_by_value(molt_test_lenpen)
    del sys.modules["molt_test_lenpen"]


def test_testing_helpers_run_estimator_and_loss_through_the_real_path(lenpen):
    groups = fake_groups([[1.0, 1.0], [0.0, 1.0]], [[1, 3], [2, 2]], info={"k": 1})
    out = run_step(lenpen.short_grpo, lenpen.seen_loss, groups, estimator_args={"alpha": 0.5},
                   step=7)
    # group 0: equal rewards, the longer rollout is penalised; group 1: lengths equal
    assert out.advantages[0] > 0 > out.advantages[1] and out.advantages[2] < 0 < out.advantages[3]
    assert out.metrics["seen/step"] == 7 and out.metrics["seen/groups"] == 2
    assert out.batch["group_index"].flatten().tolist() == [0, 0, 1, 1]
    # ratio 1 at the behavior log-probs: grad = -A / N_tokens on every sampled token
    mask = out.batch["loss_mask"]
    assert torch.allclose(out.grad[mask], -out.batch["advantages"][mask] / mask.sum())


def test_reserved_inputs_are_not_recipe_args(lenpen, tiny_recipe):
    cfg, plugins = load(tiny_recipe, ["algorithm.estimator=short_grpo", "algorithm.loss=seen_loss",
                                      "algorithm.loss_args.clip=0.3"], ["molt_test_lenpen"])
    from molt_core.config import ConfigError
    with pytest.raises(ConfigError, match="loss 'seen_loss' .* does not accept step; it accepts: "
                                          "clip$"):
        plugins.check_args("algorithm.loss_args", "loss", "seen_loss", {"step": 1})
    with pytest.raises(ConfigError, match="estimator 'short_grpo' \\(plugin molt_test_lenpen\\) "
                                          "expects a finite float, got 'x'"):
        plugins.check_args("algorithm.estimator_args", "estimator", "short_grpo", {"alpha": "x"})
