"""A step's training rows and their advantages: the seam between estimators and the trainer.
Per-rollout advantages are broadcast to the rollout's tokens, a `per_turn` estimator's [R, K] to
each model call's, a per-token estimator's taken as they are (it gets the critic's values [B, T];
a row's reward sits at its last trainable token). `kl_in: reward`: docs/algorithms.md."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from molt_core.algos import kl_estimate, masked_mean
from molt_core.config import AlgorithmConfig
from molt_core.lazy import torch
from molt_core.plugins import PluginError
from molt_core.trajectory import InvariantError, Trajectory, collate

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

    def turn_rewards(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each rollout's reward per model call [R, K] (0 past its n[R] turns, `Trajectory.turns`):
        its `turn_rewards`, else all on its last turn, which also takes whatever `rewards` (e.g.
        less a KL penalty, `kl_in: reward`) differs from their sum by. Returns (rewards, n)."""
        n = torch.tensor([len(t.turns()) for t in self.trajectories])
        out = torch.zeros(len(n), max(int(n.max()), 1))
        for i, (t, k) in enumerate(zip(self.trajectories, n.tolist())):
            if t.turn_rewards is not None and len(t.turn_rewards) != k:
                raise InvariantError(f"trajectory {t.group_id}/{t.rollout_id} has {k} model calls "
                                     f"but {len(t.turn_rewards)} turn_rewards; a per-turn "
                                     "estimator needs one reward per model call")
            out[i, :k] = torch.tensor(t.turn_rewards or [0.0] * k)
            out[i, max(k, 1) - 1] += rewards[i] - out[i].sum()
        return out, n


def opt_in(fn: Callable, **inputs: Any) -> dict[str, Any]:
    """The richer inputs `fn` asks for by naming them as parameters (the others stay unsent)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in inputs.items() if k in params}


def needs_values(estimator: Callable) -> bool:
    return bool(getattr(estimator, "needs_values", False))


def _per_turn(batch: dict[str, torch.Tensor], adv: torch.Tensor,
              rows: list[tuple[Trajectory, int]], fn: Callable, name: str) -> torch.Tensor:
    """A `per_turn` estimator's [R, K] onto each model call's tokens (`Trajectory.turns`, counted
    over a rollout's segment rows in order); returns the advantages of the rollouts' turns."""
    turn, n = torch.full(batch["loss_mask"].shape, -1), [0] * (max(i for _, i in rows) + 1)
    for b, (seg, i) in enumerate(rows):
        for start, end in seg.turns():
            turn[b, start:end], n[i] = n[i], n[i] + 1
    has = torch.arange(max(max(n), 1)) < torch.tensor(n)[:, None]              # [R, K]
    _check_shapes(fn, name, [adv], has.shape, "advantages [R, K] (one per model call: per_turn)",
                  mask=has)
    batch["advantages"] = torch.where(turn >= 0, adv[batch["rollout_index"], turn.clamp(min=0)],
                                      0.0)
    return adv[has]


def training_batch(trajs: list[Trajectory], estimator: Callable, alg: AlgorithmConfig,
                   policy: Any, temperature: float, pad_id: int
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, float]]:
    """Collate one row per segment (`Trajectory.split_segments`) with `advantages` (and `returns`,
    `old_values` for per-token estimators), its rollout's `rollout_index` and trainable
    `rollout_tokens` ([B, 1]). Returns the batch, the estimator's units' advantages and metrics."""
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
    kl, terms = torch.zeros(mask.shape), alg.terms
    if terms.kl_coef > 0 and terms.kl_in == "reward":
        ref = policy.ref_logprobs(batch, temperature)
        kl = kl_estimate(batch["behavior_logprobs"], ref, terms.kl_estimator) * mask
        metrics["kl"] = masked_mean(kl, mask).item()
    if not needs_values(estimator):
        penalty = torch.zeros(len(trajs)).index_add_(0, traj_of, kl.sum(-1))
        adv = estimator(rewards - terms.kl_coef * penalty, group_index, **alg.estimator_args,
                        **extra)
        if getattr(estimator, "per_turn", False):
            return batch, _per_turn(batch, adv, rows, estimator, alg.estimator), metrics
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
    """Outputs of `shape` and finite (at `mask`), else a PluginError naming estimator and plugin."""
    what = getattr(fn, "molt_origin", f"estimator '{name}'")
    if len(out) != n or any(not isinstance(x, torch.Tensor) or x.shape != shape for x in out):
        got = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in out]
        raise PluginError(f"{what} must return {want} of shape {tuple(shape)}; got {got}")
    bad = [int((~x[mask].isfinite() if mask is not None else ~x.isfinite()).sum()) for x in out]
    if any(bad):
        raise PluginError(f"{what} returned non-finite values ({' and '.join(map(str, bad))} of "
                          f"{want}); expected finite ones: guard its divisions (e.g. std + eps)")
