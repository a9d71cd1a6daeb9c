"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without its biases.

GRPO divides the group-centred reward by the group's std (over-weighting prompts that are too
easy or too hard) and each sequence's loss by its length (favouring long wrong answers). Dr. GRPO
drops both: the advantage is r_i - mean_g(r), and the PPO-clip loss is summed over a sequence's
tokens and divided by a constant. In Molt that is the `ppo_clip` loss with
`algorithm.loss_agg: seq-mean-token-sum`, whose normaliser is the step's number of sequences (a
constant for a fixed batch; the paper's extra 1/L_max is a constant scale absorbed by the
learning rate). `seq-mean-token-mean` would reintroduce the length bias and is rejected.
"""

from __future__ import annotations

import torch

from molt_core import hookimpl
from molt_core.algos import group_stats
from molt_core.config import Config, ConfigError

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
