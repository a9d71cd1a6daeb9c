"""Where a training step's time goes on the CPU recipe: generation, train forward/backward,
optimizer, weight sync, and everything else (framework overhead), as fractions of step time.

    python bench/step_breakdown.py [recipe] [key=value ...]
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


if __name__ == "__main__":
    main()
