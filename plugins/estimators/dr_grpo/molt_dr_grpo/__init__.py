"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without its std and
length biases (docs/algorithms.md, "Dr. GRPO"); `loss_agg: seq-mean-token-mean` is rejected."""

from __future__ import annotations

from molt_core import hookimpl
from molt_core.algos import group_stats
from molt_core.config import Config, ConfigError
from molt_core.lazy import torch

__all__ = ["dr_grpo_advantages"]


def dr_grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_g(r); a group of one gets 0. [R] -> [R]"""
    mean, _, _ = group_stats(rewards, group_index)
    return rewards - mean


@hookimpl
def molt_estimators() -> dict:
    return {"dr_grpo": dr_grpo_advantages}


@hookimpl
def molt_configure(cfg: Config) -> None:
    if cfg.algorithm.estimator == "dr_grpo" and cfg.algorithm.loss_agg == "seq-mean-token-mean":
        raise ConfigError("algorithm.estimator=dr_grpo removes GRPO's per-sequence length "
                          "normalisation, but algorithm.loss_agg=seq-mean-token-mean puts it back; "
                          "use seq-mean-token-sum (the paper's constant normaliser) or token-mean")
