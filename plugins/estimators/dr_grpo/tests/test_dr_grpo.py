"""Dr. GRPO advantages by hand and its aggregation check."""

from __future__ import annotations

import pytest
import torch

from molt_core.config import Config, ConfigError
from molt_dr_grpo import dr_grpo_advantages, molt_configure


def test_centred_without_std_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 7.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])             # group 2 has a single member
    expect = torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(dr_grpo_advantages(rewards, groups), expect)
    # no std normalisation: scaling rewards scales advantages
    assert torch.allclose(dr_grpo_advantages(10 * rewards, groups), 10 * expect)


def test_length_normalised_aggregation_is_rejected():
    cfg = Config()
    cfg.algorithm.estimator, cfg.algorithm.loss_agg = "dr_grpo", "seq-mean-token-mean"
    with pytest.raises(ConfigError, match="seq-mean-token-sum"):
        molt_configure(cfg)
    cfg.algorithm.loss_agg = "seq-mean-token-sum"
    molt_configure(cfg)
    cfg.algorithm.estimator, cfg.algorithm.loss_agg = "grpo", "seq-mean-token-mean"
    molt_configure(cfg)                                    # other estimators are not its business
