"""Per-turn credit vs trajectory-level GRPO on a multi-turn task with a reward on every turn:
steps until the mean reward (3-step running mean) first reaches each threshold, per seed, and the
median over seeds.

    python bench/turn_credit.py [--steps 100] [--seeds 1 2 3] [--estimators grpo turn_rloo gigpo]

Task: env `turn_letters` (tests/turn_env.py): turn k shows the digit k, the right reply is "abc"[k]
(1/3 reward each), a wrong reply ends the episode; tiny random-init character model, recipe
recipes/cpu/guess_number.yaml (16 groups x 8, lr 0.003, 1 token per turn), entropy bonus 0.02
(`algorithm.terms.entropy_coef=0` as an override shows the stall without it). `gigpo` runs with its
defaults (omega 1, gamma 0.95). "-" = not reached within --steps. Results: docs/algorithms.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from molt_core.cli import load
from molt_core.trainer import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))    # the turn_env plugin

RECIPE = "recipes/cpu/guess_number.yaml"
TASK = ["agent.args.env=turn_letters", "agent.args.env_args={}", "agent.args.max_turns=3",
        "agent.args.chat_template=false", "log.trajectories_every=0",
        "algorithm.terms.entropy_coef=0.02"]


def rewards(estimator: str, seed: int, steps: int, model: str,
            overrides: tuple[str, ...] = ()) -> list[float]:
    cfg, plugins = load(RECIPE, [f"model.path={model}", f"trainer.steps={steps}", f"seed={seed}",
                                 f"algorithm.estimator={estimator}", *TASK, *overrides],
                        ["turn_env"])
    return [h["reward/mean"] for h in train(cfg, plugins, None, progress=False)]


def steps_to(curve: list[float], threshold: float, window: int = 3) -> int | None:
    for i in range(window, len(curve) + 1):
        if sum(curve[i - window:i]) / window >= threshold:
            return i
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--estimators", nargs="+", default=["grpo", "turn_rloo", "gigpo"])
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.6, 0.9])
    p.add_argument("--model", default=".cache/tiny-chars")
    p.add_argument("overrides", nargs="*", help="key=value recipe overrides for every run")
    a = p.parse_args()
    print(f"{'estimator':<10} {'threshold':>9}  {'steps per seed':<22} {'median':>6}  final (last 5)")
    for est in a.estimators:
        t0 = time.perf_counter()
        curves = [rewards(est, s, a.steps, a.model, tuple(a.overrides)) for s in a.seeds]
        final = [sum(c[-5:]) / 5 for c in curves]
        for th in a.thresholds:
            n = [steps_to(c, th) for c in curves]
            # a seed that never gets there counts as beyond the run (median over seeds)
            med = statistics.median(x if x is not None else a.steps + 1 for x in n)
            print(f"{est:<10} {th:>9.2f}  {' '.join('-' if x is None else str(x) for x in n):<22} "
                  f"{'-' if med > a.steps else med:>6}  {' '.join(f'{f:.2f}' for f in final)}")
        print(f"  ({est}: {len(a.seeds)} runs of {a.steps} steps in "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
