"""Token-exact records: what an engine sampled (`Completion`) and one rollout (`Trajectory`).

Invariant 1 (token identity): trainable tokens enter a trajectory only through `add_completion`,
carrying the engine's own ids, behavior log-probs and weight versions. Prompt, tool and
environment tokens enter through `add_prompt` and are masked. `check()` re-verifies everything
where data crosses into training."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from molt_core.lazy import torch

__all__ = ["Completion", "ImageInput", "InvariantError", "Trajectory", "as_reward", "collate"]


def as_reward(value: Any) -> float:
    """A reward as a float; text is refused (float("0.5") would silently score a string)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"reward {value!r} is a {type(value).__name__}, not a number: return a "
                        "float (or int/bool)")
    return float(value)


class InvariantError(RuntimeError):
    """A token-identity or policy-version invariant was violated."""


@dataclass
class Completion:
    """One engine response: exactly the sampled ids with their log-probs and weight versions."""
    token_ids: list[int]
    logprobs: list[float]                 # log p(token) after temperature, at sampling time
    versions: list[int]                   # weight version that sampled each token
    finish_reason: str = "stop"           # stop | length | abort
    # MoE engines: [n_tokens][n_moe_layers][top_k] expert ids each token was routed to when it
    # was fed to the model (-1 rows: never fed, e.g. the last sampled token); None for dense.
    routed_experts: list[list[list[int]]] | None = None
    # MoE engines: the same for each prompt token (the prompt is the trajectory's tail when the
    # completion is added: `add_completion` writes it over that tail); None for dense.
    prompt_routed_experts: list[list[list[int]]] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise InvariantError(
                f"engine returned {n} token ids but {len(self.logprobs)} log-probs and "
                f"{len(self.versions)} versions; every sampled token needs exactly one of each")
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise InvariantError(f"engine returned {n} token ids but routing for "
                                 f"{len(self.routed_experts)}")


@dataclass
class ImageInput:
    """One image of a multimodal prompt (`molt_core.multimodal`): the image processor's patches
    and the run of placeholder tokens it fills in the token sequence (never trainable)."""
    pixel_values: torch.Tensor            # [patches, C * temporal_patch * patch * patch]
    grid_thw: list[int]                   # [t, h, w] in patches
    start: int                            # index of its first placeholder token
    num_tokens: int                       # placeholder tokens: t * h * w / merge_size**2

    def shifted(self, by: int) -> ImageInput:
        return ImageInput(self.pixel_values, self.grid_thw, self.start + by, self.num_tokens)


@dataclass
class Trajectory:
    """One rollout, token by token. Segments split it when a chat template re-renders history."""
    group_id: int = 0
    rollout_id: int = 0
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)     # 0.0 where not trainable
    versions: list[int] = field(default_factory=list)       # -1 where not trainable
    segments: list[int] = field(default_factory=lambda: [0])  # start index of each segment
    reward: float = 0.0
    turn_rewards: list[float] | None = None
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    # MoE: per token as `Completion`'s (prompt tokens too, from the next completion's
    # `prompt_routed_experts`); None until a completion carrying routing is added.
    routed_experts: list[list[list[int]]] | None = None
    images: list[ImageInput] = field(default_factory=list)   # in order of their placeholders
    # [start, end) of each model call's sampled tokens, as `add_completion` got them: an empty
    # reply (cut at a stop string) is a call too, so per-call rewards stay aligned with calls
    calls: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_prompt(self, token_ids: list[int], images: list[ImageInput] = ()) -> None:
        """Append context tokens (prompt, tool result, env feedback): never trainable. `images`:
        those whose placeholders are in `token_ids` (`start` relative to `token_ids`)."""
        n = len(token_ids)
        self.images += [im.shifted(len(self.token_ids)) for im in images]
        self.token_ids += list(token_ids)
        self.loss_mask += [False] * n
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        if self.routed_experts is not None:
            self.routed_experts += [_sentinel(self.routed_experts[0])] * n

    def add_completion(self, c: Completion) -> None:
        """Append the engine's sampled tokens as trainable, with their behavior log-probs."""
        if c.routed_experts:
            if self.routed_experts is None:
                self.routed_experts = [_sentinel(c.routed_experts[0])] * len(self.token_ids)
            if c.prompt_routed_experts:
                # the routing the engine's KV cache for our tail was built with wins
                p = len(c.prompt_routed_experts)
                if p > len(self.token_ids):
                    raise InvariantError(f"completion carries routing for {p} prompt tokens but "
                                         f"the trajectory has only {len(self.token_ids)}")
                self.routed_experts[len(self.token_ids) - p:] = c.prompt_routed_experts
            self.routed_experts += c.routed_experts
        elif self.routed_experts is not None:
            self.routed_experts += [_sentinel(self.routed_experts[0])] * len(c.token_ids)
        self.calls.append([len(self.token_ids), len(self.token_ids) + len(c.token_ids)])
        self.token_ids += c.token_ids
        self.loss_mask += [True] * len(c.token_ids)
        self.logprobs += c.logprobs
        self.versions += c.versions
        self.truncated = self.truncated or c.finish_reason == "length"

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)

    def turns(self) -> list[tuple[int, int]]:
        """[start, end) of each model call's sampled tokens (`calls`; tokens `filter_stale` masks
        stay in theirs), empty where a reply had none."""
        return [(a, b) for a, b in self.calls]

    def split_segments(self) -> list[Trajectory]:
        """One trajectory per segment, each its own training sequence (never attending to another),
        sharing ids, reward, turn rewards, truncation and info, each with its calls (a call starts
        after its prompt, so past the segment's start; an empty one may sit at its end); one
        segment: this trajectory."""
        if not any(self.segments):
            return [self]
        bounds = sorted(set(self.segments) | {0}) + [len(self)]
        return [Trajectory(self.group_id, self.rollout_id, self.token_ids[a:b], self.loss_mask[a:b],
                           self.logprobs[a:b], self.versions[a:b], [0], self.reward,
                           self.turn_rewards, self.truncated, self.info,
                           None if self.routed_experts is None else self.routed_experts[a:b],
                           [im.shifted(-a) for im in self.images if a <= im.start < b],
                           [[s - a, e - a] for s, e in self.calls if a < s <= b])
                for a, b in zip(bounds, bounds[1:]) if a != b]

    def check(self, vocab_size: int | None = None) -> None:
        """Raise `InvariantError` naming the first violated invariant."""
        n, who = len(self.token_ids), f"trajectory {self.group_id}/{self.rollout_id}"
        for name in ("loss_mask", "logprobs", "versions", "routed_experts"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise InvariantError(f"{who}: {name} has {len(getattr(self, name))} entries for "
                                     f"{n} tokens")
        if (ends := [x for c in self.calls for x in c]) != sorted(ends) or ends[-1:] > [n]:
            raise InvariantError(f"{who}: calls {self.calls} are not ordered [start, end) spans "
                                 f"of its {n} tokens; only add_completion records calls")
        end = 0
        for im in self.images:
            span = range(im.start, im.start + im.num_tokens)
            if im.start < end or span.stop > n or any(self.loss_mask[i] for i in span) or \
                    any(s in span[1:] for s in self.segments):
                raise InvariantError(f"{who}: image placeholder tokens [{span.start}, "
                                     f"{span.stop}) overlap another image, run past the {n} "
                                     "tokens, are trainable or cross a segment; images enter "
                                     "only through add_prompt")
            end = span.stop
        sampled = {i for a, b in self.calls for i in range(a, b)}
        for i, (tok, m, lp, v) in enumerate(zip(self.token_ids, self.loss_mask, self.logprobs,
                                                self.versions)):
            if not isinstance(tok, int) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise InvariantError(f"{who}: token id {tok!r} at position {i} is outside the "
                                     f"vocabulary [0, {vocab_size})")
            if m and (v < 0 or not (lp <= 0.0) or math.isinf(lp) or i not in sampled):
                raise InvariantError(f"{who}: trainable token at position {i} has no sampling "
                                     f"record (version {v}, log-prob {lp}); trainable tokens must "
                                     "come from engine completions (Trajectory.add_completion)")
        if n and self.loss_mask[0]:
            raise InvariantError("the first token of a trajectory cannot be trainable: it has no "
                                 "context to be sampled from")


def collate(trajs: list[Trajectory], advantages: list[list[float]] | None, pad_id: int = 0
            ) -> dict[str, torch.Tensor]:
    """Right-pad trajectories into [B, T]; `advantages[i]`: per token of trajs[i] (None: zeros)."""
    lens = [len(t) for t in trajs]
    B, T = len(trajs), max(lens)
    for i, (n, adv) in enumerate(zip(lens, advantages or ())):
        if len(adv) != n:
            raise InvariantError(f"advantages for trajectory {i} have {len(adv)} entries for {n} tokens")
    # one array per field from the concatenated rows, scattered by the padding mask (row-major;
    # numpy's fromiter: a third of torch.tensor's time on a list; a row too long or short raises)
    live = np.arange(T) < np.array(lens)[:, None]

    def field(rows: Any, dtype: type, fill: float) -> torch.Tensor:
        out = np.full((B, T), fill, dtype=dtype)
        out[live] = np.fromiter(itertools.chain.from_iterable(rows), dtype)
        return torch.from_numpy(out)
    out = {"input_ids": field((t.token_ids for t in trajs), np.int64, pad_id),
           "attention_mask": torch.from_numpy(live),
           "loss_mask": field((t.loss_mask for t in trajs), np.bool_, False),
           "behavior_logprobs": field((t.logprobs for t in trajs), np.float32, 0.0),
           "advantages": (torch.zeros(B, T) if advantages is None
                          else field(advantages, np.float32, 0.0)),
           "versions": field((t.versions for t in trajs), np.int64, -1)}
    shapes = {(len(t.routed_experts[0]), len(t.routed_experts[0][0]))
              for t in trajs if t.routed_experts}
    if len(shapes) > 1:
        raise InvariantError(f"trajectories carry routing of different shapes (layers, top_k): "
                             f"{sorted(shapes)}")
    if shapes:
        (L, k), = shapes
        out["routed_experts"] = torch.full((B, T, L, k), -1, dtype=torch.int32)
        for i, t in enumerate(trajs):
            if t.routed_experts:
                out["routed_experts"][i, :len(t)] = torch.tensor(t.routed_experts,
                                                                 dtype=torch.int32)
    if any(images := [t.images for t in trajs]):
        out |= _pack_images(images)
    return out


def _pack_images(rows: list[list[ImageInput]]) -> dict[str, torch.Tensor]:
    """Per-row images as row-sliceable tensors (`multimodal.unpack_rows` inverts it):
    pixel_values [B, P, D] (zero padded) and image_grid_thw [B, I, 3] (zero rows: no image)."""
    P = max(sum(len(im.pixel_values) for im in r) for r in rows)
    D = next(im.pixel_values.shape[-1] for r in rows for im in r)
    pv = torch.zeros(len(rows), P, D, dtype=torch.float32)
    grid = torch.zeros(len(rows), max(map(len, rows)), 3, dtype=torch.long)
    for b, r in enumerate(rows):
        if r:
            pv[b, :sum(len(im.pixel_values) for im in r)] = torch.cat([im.pixel_values for im in r])
            grid[b, :len(r)] = torch.tensor([im.grid_thw for im in r])
    return {"pixel_values": pv, "image_grid_thw": grid}


def _sentinel(row: list[list[int]]) -> list[list[int]]:
    """A routing row of the same [layers][top_k] shape, all -1 (no recorded routing)."""
    return [[-1] * len(r) for r in row]
