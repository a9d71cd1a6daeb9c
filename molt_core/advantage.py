"""A step's training rows and their advantages: the seam between estimators and the trainer.

Per-rollout advantages (`hookspecs.molt_estimators`) are broadcast to the rollout's tokens; a
per-token estimator gets the critic's values [B, T] from before the update, and its `returns`
train the critic. Token rewards: a row's rollout reward sits at its last trainable token (every
segment of a multi-segment rollout ends with it, as every estimator broadcasts it to each segment).
`algorithm.terms.kl_in: reward` subtracts kl_coef * kl_t (behavior vs reference log-probs) from
the token rewards; a per-rollout estimator sees the rollout's reward minus its summed penalty.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from molt_core.algos import kl_estimate, masked_mean
from molt_core.config import AlgorithmConfig
from molt_core.plugins import PluginError
from molt_core.trajectory import Trajectory, collate

__all__ = ["Rollouts", "needs_values", "opt_in", "training_batch"]


@dataclass
class Rollouts:
    """Per-rollout facts for estimators that declare a `rollouts` parameter ([R], batch order)."""
    lengths: torch.Tensor          # sampled (trainable) tokens, long
    tokens: torch.Tensor           # all tokens: prompt, sampled, tool/env replies, long
    truncated: torch.Tensor        # bool: a completion stopped at sampling.max_new_tokens
    info: list[dict[str, Any]]     # each trajectory's `info` (what the env/agent recorded)
    trajectories: list[Trajectory]

    @classmethod
    def of(cls, trajs: list[Trajectory]) -> Rollouts:
        return cls(torch.tensor([t.num_trainable for t in trajs]), torch.tensor(list(map(len, trajs))),
                   torch.tensor([t.truncated for t in trajs]), [t.info for t in trajs], trajs)


def opt_in(fn: Callable, **inputs: Any) -> dict[str, Any]:
    """The richer inputs `fn` asks for by naming them as parameters (the others stay unsent)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in inputs.items() if k in params}


def needs_values(estimator: Callable) -> bool:
    return bool(getattr(estimator, "needs_values", False))


def training_batch(trajs: list[Trajectory], estimator: Callable, alg: AlgorithmConfig,
                   policy: Any, temperature: float, pad_id: int
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, float]]:
    """Collate one row per segment (a segment never attends to another) with `advantages` (and
    `returns`, `old_values` for per-token estimators), its rollout's `rollout_index` and trainable
    `rollout_tokens` ([B, 1]). Returns the batch, the advantages of the estimator's units
    (rollouts, or trainable tokens) and metrics."""
    rows = [(s, i) for i, t in enumerate(trajs) for s in t.split_segments()]
    batch = collate([s for s, _ in rows], None, pad_id=pad_id)
    traj_of = torch.tensor([i for _, i in rows])                           # [B]
    mask = batch["loss_mask"]
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    group_index = torch.tensor([t.group_id for t in trajs])
    batch["group_index"] = group_index[traj_of][:, None]                 # [B, 1], for losses
    # a rollout's segment rows weigh as one sequence (`algos.aggregate`, sequence ratios)
    batch["rollout_index"] = traj_of[:, None]
    batch["rollout_tokens"] = torch.zeros(len(trajs), dtype=torch.long).index_add_(
        0, traj_of, mask.sum(-1))[traj_of][:, None]
    extra = {k: Rollouts.of(trajs) for k in opt_in(estimator, rollouts=None)}
    metrics: dict[str, float] = {}
    kl = torch.zeros(mask.shape)
    terms = alg.terms
    if terms.kl_coef > 0 and terms.kl_in == "reward":
        ref = policy.ref_logprobs(batch, temperature)
        kl = kl_estimate(batch["behavior_logprobs"], ref, terms.kl_estimator) * mask
        metrics["kl"] = masked_mean(kl, mask).item()
    if not needs_values(estimator):
        penalty = torch.zeros(len(trajs)).index_add_(0, traj_of, kl.sum(-1))
        adv = estimator(rewards - terms.kl_coef * penalty, group_index, **alg.estimator_args,
                        **extra)
        _check_shapes(estimator, alg.estimator, [adv], rewards.shape,
                      "advantages [R] (one per rollout)")
        batch["advantages"] = adv[traj_of][:, None] * batch["attention_mask"]
        return batch, adv, metrics
    token_rewards = -terms.kl_coef * kl
    has = mask.any(-1)
    last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)              # last trainable t
    token_rewards[has, last[has]] += rewards[traj_of][has]
    values = policy.values(batch)
    out = estimator(token_rewards, values, mask, group_index[traj_of], **alg.estimator_args,
                    **extra)
    _check_shapes(estimator, alg.estimator, out if isinstance(out, tuple) else [out], mask.shape,
                  "(advantages, returns), both [B, T] (needs_values)", 2, mask)
    adv, returns = out
    batch.update(advantages=adv * mask, returns=returns * mask, old_values=values)
    # 1 - Var(R - V) / Var(R): how much of the returns the critic explains (1 is perfect)
    var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    resid = returns - values
    var_resid = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
    metrics.update({"value/mean": masked_mean(values, mask).item(),
                    "value/explained_variance": (1 - var_resid / var.clamp(min=1e-8)).item()})
    return batch, adv[mask], metrics


def _check_shapes(fn: Callable, name: str, out: Any, shape: torch.Size, want: str, n: int = 1,
                  mask: torch.Tensor | None = None) -> None:
    """The estimator's outputs have `shape` and are finite (at `mask`): else one PluginError
    naming the estimator and its plugin."""
    what = getattr(fn, "molt_origin", f"estimator '{name}'")
    if len(out) != n or any(not isinstance(x, torch.Tensor) or x.shape != shape for x in out):
        got = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in out]
        raise PluginError(f"{what} must return {want} of shape {tuple(shape)}; got {got}")
    bad = [int((~x[mask].isfinite() if mask is not None else ~x.isfinite()).sum()) for x in out]
    if any(bad):
        raise PluginError(f"{what} returned non-finite values ({' and '.join(map(str, bad))} of "
                          f"{want}); expected finite ones: guard its divisions (e.g. std + eps)")
