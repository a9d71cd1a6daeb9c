"""The per-micro-batch training objective, pure functions of tensors and the step's spec: what one
optimizer step minimises (`objective`) and what it measures (`Tally`). `PolicyWorker.train_step`
runs the forwards, the backward and the optimizer around them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from molt_core.advantage import opt_in
from molt_core.algos import aggregate, is_correction, loss_terms
from molt_core.policy.logprobs import Forward

__all__ = ["LossFn", "Tally", "TrainStep", "nanmax", "needs_reference", "num_sequences",
           "objective"]

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class TrainStep:
    """What `Policy.train` optimises (see `objective`): `loss_fn` (a `molt_losses` entry), its
    `correction`, `terms` (`algorithm.terms`, a dict). `version`: the trainer's; the
    engine-vs-trainer gap (`mismatch/max_abs`) is measured on tokens it sampled (all when None)."""
    loss_fn: LossFn
    loss_args: dict = field(default_factory=dict)
    loss_agg: str = "token-mean"
    temperature: float = 1.0
    correction: str = "none"
    correction_args: dict = field(default_factory=dict)
    version: int | None = None
    terms: dict = field(default_factory=dict)


def needs_reference(spec: TrainStep) -> bool:
    """Whether `objective` needs pi_ref's log-probs: a KL loss term, or a loss naming them."""
    return _kl_in_loss(spec.terms or {}) or "ref_logprobs" in {
        **spec.loss_args, **opt_in(spec.loss_fn, ref_logprobs=None)}


def _kl_in_loss(terms: dict) -> bool:
    return terms.get("kl_coef", 0.0) > 0 and terms.get("kl_in", "loss") == "loss"


def num_sequences(batch: dict[str, torch.Tensor]) -> float:
    """Sequences of these rows for `aggregate`'s N_seqs: rollouts, each row counting its share of
    its rollout's trainable tokens (`rollout_tokens`); without them, rows with a trainable token."""
    mask = batch["loss_mask"]
    if "rollout_tokens" not in batch:
        return int(mask.any(-1).sum())
    return float((mask.sum(-1).double() / batch["rollout_tokens"].flatten().clamp(min=1)).sum())


def objective(spec: TrainStep, mb: dict[str, torch.Tensor], fwd: Forward, num_tokens: int,
              num_seqs: float, *, ref_logprobs: torch.Tensor | None = None, aux_coef: float = 0.0
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's loss, and its metrics ([b, T] per token or scalars):
      l_t  = loss_fn(pi_theta, pi_old, A, mask, **loss_args)_t * w_t + terms_t
      loss = aggregate(l, mask, loss_agg, N_tokens, N_seqs) + aux_coef * aux * n_seqs / N_seqs
    pi_theta = `fwd.logprobs` (`token_logprobs` of the micro-batch `mb`); pi_old = pi_prox, the
    trainer's own (`mb["prox_logprobs"]` before the batch's first step, or pi_theta detached), never
    the engine's: its kernel/bf16 gap would clip on-policy tokens. w = 1 under correction "none",
    else `algos.is_correction(pi_prox, pi_behavior, mask, correction, ...)`.
    terms: `algos.loss_terms` (KL to `ref_logprobs` if `kl_in` is "loss", entropy, the critic on
    `fwd.values`). aux: MoE's load-balancing loss, by the micro-batch's n_seqs of the step's N_seqs
    sequences (the step's sum is their mean). N_tokens, N_seqs: the whole step's (all ranks)."""
    lp, mask, behavior, terms = fwd.logprobs, mb["loss_mask"], mb["behavior_logprobs"], (
        spec.terms or {})
    # losses that name `group_index` / `rollout_index` / `ref_logprobs` get them (docs/plugins.md)
    kw = {**spec.loss_args, **opt_in(spec.loss_fn, group_index=mb.get("group_index"),
                                     rollout_index=mb.get("rollout_index"), ref_logprobs=None)}
    kw.update({k: ref_logprobs for k in kw if k == "ref_logprobs"})
    prox = mb["prox_logprobs"] if "prox_logprobs" in mb else lp.detach()
    per_token, metrics = spec.loss_fn(lp, prox, mb["advantages"], mask, **kw)
    if getattr(per_token, "shape", None) != lp.shape:   # a scalar would aggregate silently
        raise ValueError(f"loss {getattr(spec.loss_fn, '__name__', spec.loss_fn)} returned shape "
                         f"{list(getattr(per_token, 'shape', ()))}; a molt_losses loss returns "
                         f"per-token values {list(lp.shape)} (the trainer aggregates them)")
    if spec.correction != "none":
        weight, is_metrics = is_correction(prox, behavior, mask, spec.correction,
                                           rollout_index=mb.get("rollout_index"),
                                           **(spec.correction_args or {}))
        per_token, metrics = per_token * weight, {**metrics, **is_metrics}
    add, term_metrics = loss_terms(
        lp, fwd.entropy, ref_logprobs=ref_logprobs if _kl_in_loss(terms) else None,
        values=fwd.values, old_values=mb.get("old_values"), returns=mb.get("returns"),
        **{k: v for k, v in terms.items() if k not in ("kl_in", "value_lr")})
    loss = aggregate(per_token + add, mask, spec.loss_agg, num_tokens, num_seqs,
                     mb.get("rollout_tokens"))
    if fwd.aux_loss is not None and aux_coef > 0:
        loss = loss + aux_coef * fwd.aux_loss * (num_sequences(mb) / (num_seqs or 1))
    return loss, {**metrics, **term_metrics}


@dataclass
class Tally:
    """One optimizer step's metrics, micro-batch by micro-batch, as mergeable (sum, count) pairs
    and a maximum; `Policy.train` merges them over ranks and steps (sum / count, `nanmax`)."""
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    max_abs: float = 0.0            # mismatch/max_abs

    @torch.no_grad()
    def add(self, mb: dict[str, torch.Tensor], fwd: Forward, metrics: dict[str, torch.Tensor],
            version: int | None) -> None:
        """`objective`'s metrics (scalars token-weighted), `mismatch/*` between pi_prox and
        pi_behavior (max_abs on tokens `version` sampled; all when None), MoE's routing."""
        mask = mb["loss_mask"]
        n_tok, rows = float(mask.sum()), float(mask.any(-1).sum())
        prox = mb["prox_logprobs"] if "prox_logprobs" in mb else fwd.logprobs.detach()
        diff = (prox - mb["behavior_logprobs"])[mask]
        on_policy = mask if version is None else mask & (mb["versions"] == version)
        if on_policy.any():
            self.max_abs = nanmax(self.max_abs, float(diff.abs()[on_policy[mask]].max()))
        k3 = float((diff.exp() - 1 - diff).sum())  # k3 estimate of KL(behavior || trainer)
        named = {"mismatch/kl": (k3, n_tok),
                 "mismatch/on_policy_fraction": (float(on_policy.sum()), n_tok)}
        rec, used = mb.get("routed_experts"), fwd.expert_ids
        if used is not None and rec is not None:
            # Share of recorded (token, layer) routings the trainer's forward used as is:
            # 1.0 under replay; with replay off, how often trainer and engine agree.
            has = (rec >= 0).all(-1) & mb["attention_mask"][..., None]   # [b, T, L]
            same = (used.sort(-1).values == rec.sort(-1).values.to(used)).all(-1)
            named["moe/routing_agreement"] = (float((same & has).sum()), float(has.sum()))
        if fwd.aux_loss is not None:
            named["moe/aux_loss"] = (float(fwd.aux_loss) * rows, rows)
        for k, v in metrics.items():
            v = v.detach()
            named[k] = ((float((v * mask).sum()), n_tok) if v.shape == mask.shape
                        else (float(v) * n_tok, n_tok))     # scalars: token-weighted
        for k, (s, c) in named.items():
            self.sums[k] = self.sums.get(k, 0.0) + s
            self.counts[k] = self.counts.get(k, 0.0) + c


def nanmax(a: float, b: float) -> float:
    """max that keeps a NaN (Python's `max` drops it when it comes first)."""
    return a if math.isnan(a) else max(b, a)
