"""Shared pieces of every estimator and loss: masked statistics and loss aggregation.

Losses return a per-token loss [B, T]; the trainer aggregates it here with denominators counted
over the *whole optimizer step* (all micro-batches, all ranks), so gradient accumulation and data
parallelism never change the objective.
"""

from __future__ import annotations

import torch

__all__ = ["aggregate", "group_stats", "masked_mean"]


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
