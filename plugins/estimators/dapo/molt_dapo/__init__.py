"""DAPO (Yu et al., 2025): clip-higher, dynamic sampling, overlong reward shaping, token-mean
(formulas: docs/algorithms.md, "DAPO"). Overlong shaping, then dynamic sampling, run in
`molt_filter_batch`: only trajectories know lengths (estimators receive rewards only)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from molt_core import hookimpl
from molt_core.algos import clipped_surrogate, group_stats
from molt_core.config import Config, ConfigError
from molt_core.lazy import torch
from molt_core.trajectory import Trajectory

__all__ = ["DapoConfig", "DynamicSampler", "dapo_advantages", "dapo_loss", "overlong_penalty",
           "response_length"]

Groups = list[list[Trajectory]]


@dataclass
class DapoConfig:
    dynamic_sampling: bool | None = None    # None: on when algorithm.estimator is dapo
    max_refill_rounds: int = 10             # refill calls per step before giving up
    overlong_buffer: int = 0                # Lcache in tokens; 0 = no overlong shaping
    max_length: int = 0                     # Lmax of one response; 0 = sampling.max_new_tokens
    overlong_penalty_factor: float = 1.0


def dapo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *,
                    eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g(r)) / (std_g(r) + eps); flat groups, groups of one: 0. [R] -> [R]"""
    mean, std, _ = group_stats(rewards, group_index)
    return torch.where(std > 0, (rewards - mean) / (std + eps), torch.zeros_like(rewards))


def dapo_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.28
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-higher: l_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)). All [B, T]."""
    ratio = torch.exp(logprobs - behavior_logprobs)
    loss, clipped = clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return loss * mask.to(loss.dtype), {"clip_fraction": clipped.float(), "ratio": ratio.detach()}


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment r_len(L) in [-1, 0] (eq. 13 of the paper)."""
    if length <= max_length - buffer:
        return 0.0
    return (max_length - buffer - length) / buffer if length <= max_length else -1.0


def response_length(traj: Trajectory) -> int:
    """Tokens of the longest engine response, as `sampling.max_new_tokens` caps each call (one
    turn): a run of sampled tokens (version >= 0, kept when `filter_stale` masks them)."""
    runs = itertools.groupby(v >= 0 for v in traj.versions)
    return max((len(list(g)) for sampled, g in runs if sampled), default=0)


class DynamicSampler:
    """The per-run state of DAPO's batch filter (built by `molt_configure`)."""

    def __init__(self, opts: DapoConfig, max_length: int, dynamic_sampling: bool) -> None:
        self.opts, self.max_length, self.dynamic = opts, max_length, dynamic_sampling
        self.stats: Counter[str] = Counter()

    def shape(self, groups: Groups) -> None:
        """Add the overlong penalty to each trajectory's reward (once; recorded in `info`)."""
        if self.opts.overlong_buffer <= 0:
            return
        for traj in (t for g in groups for t in g if "overlong_penalty" not in t.info):
            pen = self.opts.overlong_penalty_factor * overlong_penalty(
                response_length(traj), self.max_length, self.opts.overlong_buffer)
            traj.info["overlong_penalty"] = pen
            traj.reward += pen
            self.stats["dapo/overlong_penalized"] += pen < 0

    def __call__(self, groups: Groups, refill: Callable[[int], Groups]) -> Groups:
        self.stats.clear()
        self.shape(groups)
        if not self.dynamic:
            return groups
        target, seen = len(groups), len(groups)
        kept = [g for g in groups if _reward_varies(g)]
        rounds = 0
        while len(kept) < target and rounds < self.opts.max_refill_rounds:
            rounds += 1
            need = target - len(kept)
            # ask for more than the deficit in proportion to how many groups survive (<= 4x)
            rate = max(len(kept) / seen, 0.25)
            new = refill(min(math.ceil(need / rate), 4 * need))
            self.shape(new)
            seen += len(new)
            kept += [g for g in new if _reward_varies(g)]
        self.stats.update({"dapo/refill_rounds": rounds, "dapo/groups_generated": seen,
                           "dapo/groups_dropped": seen - len(kept),
                           "dapo/groups_unused": max(len(kept) - target, 0)})
        if not kept:
            raise RuntimeError(
                f"DAPO dynamic sampling: all {seen} groups of this step had equal rewards within "
                f"each group after {rounds} refill rounds (dapo.max_refill_rounds); the task is "
                "solved or unsolvable at this point. Raise dapo.max_refill_rounds or set "
                "dapo.dynamic_sampling=false")
        if len(kept) < target:              # rounds ran out: train on fewer groups, counted
            self.stats["dapo/short_batch"] = 1
        return kept[:target]


def _reward_varies(group: list[Trajectory]) -> bool:
    rewards = [t.reward for t in group]
    return max(rewards) > min(rewards)


_sampler: DynamicSampler | None = None      # this process's run, set by molt_configure


@hookimpl
def molt_estimators() -> dict:
    return {"dapo": dapo_advantages}


@hookimpl
def molt_losses() -> dict:
    return {"dapo": dapo_loss}


@hookimpl
def molt_config_sections() -> dict:
    return {"dapo": DapoConfig}


@hookimpl
def molt_configure(cfg: Config) -> None:
    global _sampler
    _sampler = None                         # a rejected config leaves no filter from an earlier run
    opts: DapoConfig = cfg.plugins.get("dapo") or DapoConfig()
    dynamic = (cfg.algorithm.estimator == "dapo" if opts.dynamic_sampling is None
               else opts.dynamic_sampling)
    max_length = opts.max_length or cfg.sampling.max_new_tokens
    if opts.overlong_buffer < 0 or opts.overlong_buffer >= max_length:
        raise ConfigError(f"dapo.overlong_buffer must be in [0, max length {max_length}) (got "
                          f"{opts.overlong_buffer}); it is Lcache, the soft-penalty zone before "
                          "dapo.max_length (default sampling.max_new_tokens)")
    if opts.max_refill_rounds < 0:
        raise ConfigError(f"dapo.max_refill_rounds must be >= 0 (got {opts.max_refill_rounds})")
    if dynamic and cfg.rollout.group_size < 2:
        raise ConfigError("DAPO dynamic sampling drops groups whose rewards are all equal, which "
                          "is every group of one: set rollout.group_size >= 2 or "
                          "dapo.dynamic_sampling=false")
    active = dynamic or opts.overlong_buffer > 0
    _sampler = DynamicSampler(opts, max_length, dynamic) if active else None


@hookimpl
def molt_filter_batch(groups: Groups, step: int, refill: Callable[[int], Groups]) -> Groups | None:
    return _sampler(groups, refill) if _sampler else None


@hookimpl
def molt_on_step_end(step: int, metrics: dict[str, Any]) -> None:
    if _sampler:
        metrics.update({k: float(v) for k, v in _sampler.stats.items()})
