"""Shared pieces of every estimator and loss: masked statistics, loss aggregation, the clipped
ratio objective, KL estimators and entropy.

Losses return a per-token loss [B, T]; the trainer aggregates it here with denominators counted
over the *whole optimizer step* (all micro-batches, all ranks), so gradient accumulation and data
parallelism never change the objective.
"""

from __future__ import annotations

import torch

__all__ = ["aggregate", "clipped_surrogate", "entropy_from_logits", "group_stats", "kl_estimate",
           "masked_mean", "masked_whiten"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str,
              num_tokens: int, num_seqs: int) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to this micro-batch's share of the step's loss.

    token-mean:           sum_{i,t} l_it / N_tokens
    seq-mean-token-sum:   sum_i (sum_t l_it) / N_seqs
    seq-mean-token-mean:  sum_i (mean_t l_it) / N_seqs
    N_tokens and N_seqs are global counts for the optimizer step (sequences with no trainable
    token do not count).
    """
    m = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * m).sum() / max(num_tokens, 1)
    per_seq = (per_token * m).sum(-1)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / max(num_seqs, 1)
    if mode == "seq-mean-token-mean":
        return (per_seq / m.sum(-1).clamp(min=1)).sum() / max(num_seqs, 1)
    raise ValueError(f"unknown loss aggregation '{mode}'; valid: token-mean, "
                     "seq-mean-token-sum, seq-mean-token-mean")


def group_stats(values: torch.Tensor, group_index: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element group mean, unbiased std (0 for groups of one) and group size. [R] -> 3x[R]."""
    _, inv, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    G = counts.numel()
    v = values.to(torch.float64)
    sums = torch.zeros(G, dtype=v.dtype).index_add_(0, inv, v)
    mean = sums / counts
    sq = torch.zeros(G, dtype=v.dtype).index_add_(0, inv, (v - mean[inv]) ** 2)
    std = torch.where(counts > 1, (sq / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return (mean[inv].to(values.dtype), std[inv].to(values.dtype), counts[inv])


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and (biased) std over `mask`; 0 outside the mask.

    `shift_mean=False` only rescales (x / (std + eps)). One masked element: std 0, so x - mean = 0.
    """
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    std = masked_mean((x - mean) ** 2, m).sqrt()
    out = (x - mean if shift_mean else x) / (std + eps)
    return out * m


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective as a loss: l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)).

    Returns the per-element loss and where the clipped branch is active (there the gradient
    through `ratio` is zero). Same shape as `ratio`; `clip_low != clip_high` is DAPO clip-higher.
    """
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
    Use as a loss term (differentiable in `logprobs`) or, detached, as a reward penalty.
    """
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

    [..., V] -> [...]; the entropy bonus of a loss is -coef * H at trainable tokens.
    """
    logits = logits.float()
    p = torch.softmax(logits, -1)
    return torch.logsumexp(logits, -1) - (p * logits).sum(-1)
