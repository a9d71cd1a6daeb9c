"""Shared pieces of every estimator and loss: masked statistics, loss aggregation over the whole
optimizer step (so gradient accumulation and data parallelism never change the objective), the
clipped ratio objective, KL estimators, entropy, the value loss and off-policy corrections."""

from __future__ import annotations

import math

from molt_core.lazy import torch

__all__ = ["CORRECTIONS", "aggregate", "clipped_surrogate", "entropy_from_logits", "group_stats",
           "is_correction", "kl_estimate", "loss_terms", "masked_mean", "masked_whiten",
           "reward_to_go", "rollout_sum", "value_loss"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: int,
              num_seqs: float, seq_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to this micro-batch's share of the step's loss.

    token-mean:           sum_{i,t} l_it / N_tokens
    seq-mean-token-sum:   sum_i (sum_t l_it) / N_seqs
    seq-mean-token-mean:  sum_i (mean_t l_it) / N_seqs
    N_tokens and N_seqs are global counts for the optimizer step (sequences with no trainable
    token do not count). A sequence i is a rollout: the rows of its segments add up, the mean is
    over its `seq_tokens` [B, 1] (each row's rollout's trainable tokens; None: the row's own) and
    N_seqs counts rollouts (`objective.num_sequences`)."""
    m = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * m).sum() / max(num_tokens, 1)
    per_seq = (per_token * m).sum(-1)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / (num_seqs or 1)
    if mode == "seq-mean-token-mean":
        n = m.sum(-1) if seq_tokens is None else seq_tokens.flatten().to(m.dtype)
        return (per_seq / n.clamp(min=1)).sum() / (num_seqs or 1)
    raise ValueError(f"unknown loss aggregation '{mode}'; valid: token-mean, "
                     "seq-mean-token-sum, seq-mean-token-mean")


def rollout_sum(x: torch.Tensor, rollout_index: torch.Tensor | None) -> torch.Tensor:
    """Per-row values x [B, 1] summed over the rows of each row's rollout (`rollout_index` [B, 1]:
    the segments of a re-rendered chat); None: every row is its own rollout."""
    if rollout_index is None:
        return x
    _, inv = torch.unique(rollout_index.flatten(), return_inverse=True)
    return x.new_zeros(int(inv.max()) + 1, *x.shape[1:]).index_add(0, inv, x)[inv]


def reward_to_go(turn_rewards: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_k = sum_{k' >= k} gamma^(k' - k) r_k'. [R, K] -> [R, K]"""
    out, acc = torch.zeros_like(turn_rewards), torch.zeros_like(turn_rewards[:, 0])
    for k in reversed(range(turn_rewards.shape[1])):
        out[:, k] = acc = turn_rewards[:, k] + gamma * acc
    return out


def group_stats(values: torch.Tensor, group_index: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element group mean, unbiased std (0 for groups of one) and group size. [R] -> 3x[R]."""
    _, inv, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    G, v = counts.numel(), values.to(torch.float64)
    mean = torch.zeros(G, dtype=v.dtype).index_add_(0, inv, v) / counts
    sq = torch.zeros(G, dtype=v.dtype).index_add_(0, inv, (v - mean[inv]) ** 2)
    std = torch.where(counts > 1, (sq / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return (mean[inv].to(values.dtype), std[inv].to(values.dtype), counts[inv])


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and (biased) std over `mask`; 0 outside the mask.

    `shift_mean=False` only rescales (x / (std + eps)). One masked element: std 0, x - mean = 0."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    std = masked_mean((x - mean) ** 2, m).sqrt()
    return (x - mean if shift_mean else x) / (std + eps) * m


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective as a loss: l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)).

    Returns the per-element loss and where the clipped branch is active (there the gradient
    through `ratio` is zero). Same shape as `ratio`; `clip_low != clip_high` is DAPO clip-higher."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3"
                ) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL").

    With log rho = ref_logprobs - logprobs:
      k1 = -log rho                 (unbiased, high variance, can be negative)
      k2 = (log rho)^2 / 2          (biased, low variance; its gradient is the KL gradient)
      k3 = (rho - 1) - log rho      (unbiased, low variance, >= 0)
    Use as a loss term (differentiable in `logprobs`) or, detached, as a reward penalty."""
    log_rho = ref_logprobs - logprobs
    if kind == "k1":
        return -log_rho
    if kind == "k2":
        return 0.5 * log_rho ** 2
    if kind == "k3":
        # clamp: exp of a large log-ratio overflows before the subtraction can cancel it
        return torch.exp(log_rho.clamp(max=20.0)) - 1.0 - log_rho
    raise ValueError(f"unknown KL estimator '{kind}'; valid: k1, k2, k3")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: H = logsumexp(z) - sum_v p_v z_v.

    [..., V] -> [...]; the entropy bonus of a loss is -coef * H at trainable tokens."""
    logits = logits.float()
    p = torch.softmax(logits, -1)
    return torch.logsumexp(logits, -1) - (p * logits).sum(-1)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's clipped regression loss (PPO2): with v_c = v_old + clip(v - v_old, -c, c),
    l_t = 1/2 max((v_t - R_t)^2, (v_c,t - R_t)^2); `clip` 0: l_t = 1/2 (v_t - R_t)^2.

    All [B, T]; returns the per-token loss and where the clipped branch is larger (there the
    gradient through `values` is zero)."""
    unclipped = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_c = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (v_c - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def loss_terms(logprobs: torch.Tensor, entropy: torch.Tensor, *,
               ref_logprobs: torch.Tensor | None = None, values: torch.Tensor | None = None,
               old_values: torch.Tensor | None = None, returns: torch.Tensor | None = None,
               kl_coef: float = 0.0, kl_estimator: str = "k3", entropy_coef: float = 0.0,
               value_coef: float = 0.5, value_clip: float = 0.2
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What the trainer adds to any loss's per-token value (`algorithm.terms`), all [B, T]:

      + kl_coef * kl_t(logprobs, ref_logprobs)     (when `ref_logprobs` is given)
      - entropy_coef * H_t                         (entropy bonus)
      + value_coef * value_loss_t                  (the critic, when `values` are given)
    Metrics: `entropy` always, `kl`, `value/loss`, `value/clip_fraction` when computed."""
    add = -entropy_coef * entropy if entropy_coef else torch.zeros_like(logprobs)
    metrics = {"entropy": entropy.detach()}
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        add = add + kl_coef * kl
        metrics["kl"] = kl.detach()
    if values is not None:
        vl, clipped = value_loss(values, old_values, returns, value_clip)
        add = add + value_coef * vl
        metrics.update({"value/loss": vl.detach(), "value/clip_fraction": clipped.float()})
    return add, metrics


# Off-policy correction modes and their thresholds (`algorithm.correction`, `correction_args`).
CORRECTIONS: dict[str, dict[str, float]] = {
    "none": {},
    "tis": {"cap": 2.0},                       # truncated IS: w -> min(w, cap)
    "icepop": {"low": 0.5, "high": 2.0},       # w inside [low, high], else 0 (IcePop)
    "mis": {"cap": 2.0},                       # sequence rho * 1[rho <= cap] (Liu et al.)
    "geo_mask": {"low": 0.5, "high": 2.0},     # 1 if the sequence geometric mean is in the band
}


def is_correction(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                  mode: str, *, rollout_index: torch.Tensor | None = None,
                  **thresholds: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weight [B, T] that corrects a loss computed against the proximal policy for
    sampling by the behavior policy (the engine, possibly stale weights or other kernels).

    With w_t = exp(logprobs_t - behavior_logprobs_t) (`logprobs`: pi_prox, the trainer's
    log-probs before the batch's first optimizer step; used detached):
      tis:      weight_t = min(w_t, cap)                          (token-level truncated IS)
      icepop:   weight_t = w_t * 1[low <= w_t <= high]            (IcePop, Ring-1T report)
      mis:      weight_t = rho * 1[rho <= cap], rho = prod_s w_s  (sequence masked IS, Liu et al.)
      geo_mask: weight_t = 1[low <= exp(mean_s log w_s) <= high]  (sequence rejection, weight 1)
      none:     weight_t = 1
    A sequence (s) is a rollout: all rows of its `rollout_index` [B, 1] (`rollout_sum`).
    The weight is 0 outside `mask`. Metrics ([B, T], averaged over trainable tokens):
    `is_filtered_fraction` (tokens whose weight was zeroed), `is_truncated_fraction` (TIS tokens
    whose w exceeded the cap), `is_weight` (the weight applied)."""
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown off-policy correction '{mode}'; valid: {', '.join(CORRECTIONS)}")
    if unknown := set(thresholds) - set(CORRECTIONS[mode]):
        raise ValueError(f"correction '{mode}' takes {sorted(CORRECTIONS[mode])}, got {sorted(unknown)}")
    th = {**CORRECTIONS[mode], **thresholds}
    m = mask.bool()
    log_w = torch.where(m, logprobs.detach().float() - behavior_logprobs.float(), 0.0)
    w = log_w.clamp(max=20.0).exp()
    zero = torch.zeros_like(w)
    truncated = zero.bool()
    if mode == "none":
        weight = torch.ones_like(w)
    elif mode == "tis":
        truncated = w > th["cap"]
        weight = w.clamp(max=th["cap"])
    elif mode == "icepop":
        weight = torch.where((w >= th["low"]) & (w <= th["high"]), w, zero)
    elif mode == "mis":
        log_rho = rollout_sum(log_w.sum(-1, keepdim=True), rollout_index)    # [B, 1]
        # exp overflows only where rho > cap, and those sequences get 0 anyway
        rho = log_rho.clamp(max=math.log(th["cap"])).exp()
        weight = torch.where(log_rho <= math.log(th["cap"]), rho, 0.0).expand_as(w)
    else:  # geo_mask
        n = rollout_sum(m.sum(-1, keepdim=True).to(w.dtype), rollout_index).clamp(min=1)
        geo = (rollout_sum(log_w.sum(-1, keepdim=True), rollout_index) / n).exp()   # [B, 1]
        weight = ((geo >= th["low"]) & (geo <= th["high"])).to(w.dtype).expand_as(w)
    weight = torch.where(m, weight, zero)
    return weight, {"is_filtered_fraction": (m & (weight == 0)).float(),
                    "is_truncated_fraction": (truncated & m).float(), "is_weight": weight}
