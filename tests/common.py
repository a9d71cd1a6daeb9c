"""Helpers several test files share (tests/ is on sys.path under pytest)."""

from __future__ import annotations

import ray
import torch

from molt_core.trajectory import Completion, Trajectory, collate


def sample_batch(engine, prompts: list[list[int]], sampling: dict, advantages=None
                 ) -> tuple[list[Completion], list[Trajectory], dict[str, torch.Tensor]]:
    """One completion per prompt from an engine actor, collated with one advantage per row
    (default 1.0)."""
    outs = ray.get([engine.generate.remote(p, sampling) for p in prompts], timeout=120)
    trajs = []
    for p, c in zip(prompts, outs):
        trajs.append(Trajectory())
        trajs[-1].add_prompt(p)
        trajs[-1].add_completion(c)
    adv = [1.0] * len(trajs) if advantages is None else [float(a) for a in advantages]
    return outs, trajs, collate(trajs, [[a] * len(t) for a, t in zip(adv, trajs)])


def reference_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Plain full-vocab forward of an unsharded HF model: [B, T], 0 where not trainable."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    out = torch.zeros(batch["input_ids"].shape)
    out[:, 1:] = lp
    return out * batch["loss_mask"]
