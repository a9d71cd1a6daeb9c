"""Helpers several test files share (tests/ is on sys.path under pytest)."""

from __future__ import annotations

from pathlib import Path

import ray
import torch
import yaml

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


def toy_recipe(tmp_path: Path, model: Path, **sections) -> str:
    """recipes/cpu/next_letter.yaml on `model` with 4x4 rollouts per step, written to tmp_path;
    `sections` update the recipe's (a dict) or set a top-level key."""
    data = yaml.safe_load(open(Path(__file__).parents[1] / "recipes/cpu/next_letter.yaml"))
    data["model"]["path"] = str(model)
    data["rollout"].update(groups_per_step=4, group_size=4)
    for k, v in sections.items():
        data.setdefault(k, {}).update(v) if isinstance(v, dict) else data.__setitem__(k, v)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)
