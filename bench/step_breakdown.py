"""Where a training step's time goes on the CPU recipe: generation, train forward/backward,
optimizer, weight sync, and everything else (framework overhead), as fractions of step time.

    python bench/step_breakdown.py [recipe] [key=value ...]

Measured 2026-12-01 (next_letter, 16x8 rollouts, 1 rank, 1 engine, load 0.8-1.7): steps of 62-81
ms; framework overhead 10.0-10.8 % of a step in six runs (18.6 % before `collate` built one tensor
per field instead of five per row, 10.8-13.1 % before the trainer's batches crossed Ray as numpy:
its tensor path costs ~0.2 ms per tensor). What is left: the train call's Ray hop, 2.0 ms from
submit to the worker's first line and 1.5 ms from its return to the driver (a no-op Ray call is
0.7 ms round trip here), and the loop's own work, ~3 ms (`training_batch` 1.4-2.0, rollout
metrics 0.6, the metrics sink 0.3). A one-rank trainer in the driver's process (an experiment,
not landed) measured 7.8-8.2 % against 10.5-10.6 % with the actor.
"""

from __future__ import annotations

import statistics
import sys

from molt_core.cli import load
from molt_core.metrics import configure_logging
from molt_core.trainer import train


def main() -> None:
    recipe = sys.argv[1] if len(sys.argv) > 1 else "recipes/cpu/next_letter.yaml"
    overrides = ["trainer.steps=30", *sys.argv[2:]]
    configure_logging()
    cfg, plugins = load(recipe, overrides)
    history = train(cfg, plugins, None, progress=False)[5:]   # skip warm-up steps
    parts = {
        "generation": "time/generate_s",
        "train fwd/bwd": "train/fwd_bwd_s",
        "optimizer": "train/optim_s",
        "weight sync": "time/weight_sync_s",
    }
    step = statistics.mean(h["time/step_s"] for h in history)
    print(f"{len(history)} steps after warm-up, mean step {step * 1000:.1f} ms "
          f"({cfg.rollout.groups_per_step}x{cfg.rollout.group_size} rollouts, "
          f"{cfg.trainer.num_ranks} trainer rank(s), {cfg.engine.num_engines} engine(s))")
    total = 0.0
    for name, key in parts.items():
        t = statistics.mean(h.get(key, 0.0) for h in history)
        total += t
        print(f"  {name:<22} {t * 1000:8.1f} ms  {t / step:6.1%}")
    print(f"  {'framework overhead':<22} {(step - total) * 1000:8.1f} ms  {(step - total) / step:6.1%}")
    # where the overhead sits: the train call's round trip (Ray, batch transfer, the split across
    # ranks) and the loop's own work (collate, estimator, metrics, checks)
    mean = lambda key: statistics.mean(h.get(key, 0.0) for h in history)   # noqa: E731
    rpc = mean("time/train_s") - mean("train/fwd_bwd_s") - mean("train/optim_s")
    loop = step - mean("time/generate_s") - mean("time/train_s") - mean("time/weight_sync_s")
    for name, t in (("  of it: train call", rpc), ("  of it: loop", loop)):
        print(f"  {name:<22} {t * 1000:8.1f} ms  {t / step:6.1%}")


if __name__ == "__main__":
    main()
