"""What verified weight syncs cost on the CPU recipe (issue 25 item 12): the per-tensor checksums
(sender and engine) and the canary (every engine and the trainer score a fixed text) against the
step and the weight sync without them.

    python bench/sync_verify.py [recipe] [key=value ...]     (model.path=DIR of `molt tiny-model DIR --chars`)

Two runs of the recipe, `check.canary_every=1` and `=0`. The canary is timed around
`EngineRestarts.check_canary`; the checksums around the sender's `weight_sync.checksums` (the
driver's: one CPU rank runs there), doubled for the engine's own pass over the same bytes (it runs
before the sender's `finish_weight_update` returns, so in series).

Measured 2026-12-02 (next_letter, 16x8 rollouts, 1 rank, 1 hf engine; 2 cores shared with other
runs, steps of 111-161 ms where a quiet box gives 55-62): checksums 2.5-3.2 ms a sync (1.6-2.3 %
of a step; alone 0.4 ms a side), the canary 26-28 ms (18 % of a step at every sync, 1.8-1.9 % at
the default check.canary_every=10).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import torch

from molt_core import weight_sync
from molt_core.cli import load
from molt_core.rollout.restarts import EngineRestarts
from molt_core.run.metrics import configure_logging
from molt_core.trainer import train

SPENT = {"canary": [], "checksums": []}


def timed(fn, key):
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            SPENT[key].append(time.perf_counter() - t)
    return wrapper


def run(recipe: str, overrides: list[str]) -> list[dict]:
    cfg, plugins = load(recipe, overrides)
    return train(cfg, plugins, None, progress=False)[5:]      # skip warm-up steps


def main() -> None:
    recipe = sys.argv[1] if len(sys.argv) > 1 else "recipes/cpu/next_letter.yaml"
    overrides = ["trainer.steps=40", "check.consistency_every=0", *sys.argv[2:]]
    configure_logging()
    EngineRestarts.check_canary = timed(EngineRestarts.check_canary, "canary")
    weight_sync.checksums = timed(weight_sync.checksums, "checksums")
    mean = lambda rows, k: statistics.mean(h[k] for h in rows)   # noqa: E731
    off = run(recipe, [*overrides, "check.canary_every=0"])
    sums_per_sync = sum(SPENT["checksums"]) / (len(off) + 5)
    SPENT["canary"].clear()
    on = run(recipe, [*overrides, "check.canary_every=1"])
    canary = statistics.mean(SPENT["canary"][5:])
    step = mean(on, "time/step_s")
    print(f"{len(on)} steps after warm-up each; step {step * 1e3:.1f} ms with the canary, "
          f"{mean(off, 'time/step_s') * 1e3:.1f} ms without")
    print(f"  weight sync (with checksums)  {mean(off, 'time/weight_sync_s') * 1e3:7.2f} ms "
          f"without the canary, {mean(on, 'time/weight_sync_s') * 1e3:7.2f} ms with it")
    print(f"  checksums, sender + engine    {2 * sums_per_sync * 1e3:7.2f} ms  "
          f"{2 * sums_per_sync / step:6.2%} of a step")
    print(f"  canary (every sync)           {canary * 1e3:7.2f} ms  {canary / step:6.2%} of a step")
    for every in (10,):
        print(f"  canary every {every} syncs          {canary / every * 1e3:7.2f} ms  "
              f"{canary / every / step:6.2%} of a step")
    big = [(str(i), torch.randn(1024, 1024)) for i in range(32)]       # 128 MiB fp32
    t = time.perf_counter()
    for _ in range(5):
        weight_sync.checksums.__wrapped__(big)
    print(f"  checksums of 128 MiB fp32 (one side, {torch.get_num_threads()} threads) "
          f"{(time.perf_counter() - t) / 5 * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
