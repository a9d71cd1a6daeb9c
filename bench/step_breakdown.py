"""Where a training step's time goes on the CPU recipe: generation, train forward/backward,
optimizer, weight sync, and everything else (framework overhead), as fractions of step time.

    python bench/step_breakdown.py [recipe] [key=value ...]

Measured 2026-12-01 (next_letter, 16x8 rollouts, 1 rank, 1 engine, load 0.1-1.0): steps of 54-62
ms; framework overhead 3.1-3.5 % of a step (1.9-2.1 ms: the train call 0.5, the loop 1.4-1.5).
Before: 18.6 % when `collate` built five tensors per row; 10.8-13.1 % when the trainer's batches
crossed Ray as tensors (~0.2 ms per tensor); 10.0-10.8 % with numpy, of which the train call's Ray
hop was ~3.5 ms (2.0 from submit to the rank, 1.5 back; a no-op Ray call is 0.7 ms round trip)
and the loop ~3 ms. Now one CPU rank runs in the driver's process (`trainer.in_driver`; the same
run with the rank as an actor, `trainer.in_driver=false`: 9.0 %, its train call 4.6 ms), `collate`
fills its fields with numpy's `fromiter`, a one-segment rollout is not copied and the version-lag
metrics take one pass (the loop: ~3 -> 1.2-1.5 ms).
"""

from __future__ import annotations

import statistics
import sys

from molt_core.cli import load
from molt_core.run.metrics import configure_logging
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
