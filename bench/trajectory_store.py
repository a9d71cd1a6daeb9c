"""What saving trajectories costs on the CPU recipe, measured in one run so that the load of a
shared box cancels out: `log.trajectories_every=2` saves the even steps, and the writer thread
works during the odd steps that follow; the overhead is the paired difference of each odd step
minus the even step before it, plus the loop's synchronous part (requesting the trainer's
log-probs and queueing). Also: the writer thread's time and the file size per step.

    python bench/trajectory_store.py [recipe] [key=value ...]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from molt_core import trajectory_store
from molt_core.cli import load
from molt_core.metrics import configure_logging
from molt_core.trainer import train


def timed(owner: object, name: str, into: list[float]) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            into.append(time.perf_counter() - t)
    setattr(owner, name, wrapper)


def main() -> None:
    recipe = sys.argv[1] if len(sys.argv) > 1 else "recipes/cpu/next_letter.yaml"
    overrides = ["trainer.steps=122", "check.consistency_every=0", "log.trajectories_every=2",
                 *sys.argv[2:]]
    configure_logging("WARNING")
    sync_s: list[float] = []
    rows_s: list[float] = []
    write_s: list[float] = []
    timed(trajectory_store.TrajectoryWriter, "write", sync_s)
    timed(trajectory_store, "trajectory_rows", rows_s)
    timed(trajectory_store, "write_trajectories", write_s)
    cfg, plugins = load(recipe, overrides)
    run_dir = Path(tempfile.mkdtemp(prefix="molt-bench-"))
    steps = [h["time/step_s"] for h in train(cfg, plugins, run_dir, progress=False)][10:]
    # even steps (saved) have the synchronous part; odd ones run beside the writer thread
    diffs = [steps[i + 1] - steps[i] for i in range(0, len(steps) - 1, 2)]
    base = statistics.mean(steps[0::2])
    sync = statistics.mean(sync_s[10::2])         # write() on saved (even) steps only
    files = list((run_dir / "trajectories").glob("*.parquet"))
    overhead = statistics.mean(diffs) + sync
    print(f"{cfg.rollout.groups_per_step}x{cfg.rollout.group_size} rollouts per step, "
          f"{len(diffs)} step pairs after warm-up; mean step {base * 1000:.1f} ms")
    print(f"  loop's synchronous part   {sync * 1000:8.2f} ms  ({sync / base:.2%} of a step)")
    print(f"  step beside the writer    {statistics.mean(diffs) * 1000:+8.2f} ms  "
          f"(paired; s.e. {statistics.stdev(diffs) / len(diffs) ** 0.5 * 1000:.2f} ms)")
    print(f"  saving every step adds    {overhead * 1000:+8.2f} ms  ({overhead / base:+.2%})")
    rows, write = statistics.mean(rows_s), statistics.mean(write_s)
    print(f"  writer thread             {(rows + write) * 1000:8.2f} ms per saved step (rows + "
          f"decode {rows * 1000:.2f}, parquet {write * 1000:.2f})")
    size = sum(f.stat().st_size for f in files) / len(files)
    print(f"  file size                 {size / 1024:8.1f} KiB per saved step")


if __name__ == "__main__":
    main()
