"""The per-micro-batch training objective: what one optimizer step minimises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["LossFn", "TrainStep"]

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class TrainStep:
    """What `Policy.train` optimises. `loss_fn(logprobs, behavior_logprobs, advantages, mask,
    **loss_args) -> (per_token_loss, metrics)` (a `molt_losses` entry), aggregated with
    `loss_agg` (`algos.aggregate`) over the optimizer step. `correction` "none": the loss's ratio
    is pi_theta / pi_behavior (the engine's log-probs); otherwise (decoupled PPO) it is
    pi_theta / pi_prox and the per-token value is multiplied by the off-policy weight of
    `algos.is_correction(pi_prox, pi_behavior, correction, **correction_args)`. `version`: the
    trainer's weight version; the engine-vs-trainer gap (`mismatch/max_abs`, invariant 3) is
    measured on tokens it sampled (all when None). `terms` (`algorithm.terms` as a dict): KL,
    entropy and, when the batch has `returns`, critic terms (`algos.loss_terms`)."""
    loss_fn: LossFn
    loss_args: dict = field(default_factory=dict)
    loss_agg: str = "token-mean"
    temperature: float = 1.0
    correction: str = "none"
    correction_args: dict = field(default_factory=dict)
    version: int | None = None
    terms: dict = field(default_factory=dict)
