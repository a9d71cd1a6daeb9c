"""What saving trajectories costs on the CPU recipe, measured in one run so that the load of a
shared box cancels out: `log.trajectories_every=2` saves the even steps, and the writer process
works during the odd steps that follow; the overhead is the paired difference of each odd step
minus the even step before it, plus the loop's synchronous part (taking the trainer's log-probs,
which came back with the training step, and queueing). Also: the writer process's work and the
file size per saved step, and the hand-off (pickling the step) that the loop's process does in
its thread. The trimmed mean's s.e. is from the winsorized spread.

    python bench/trajectory_store.py [recipe] [key=value ...]

Measured (toy recipe, 16x8 rollouts per step, 2-core box shared with other jobs: each run waited
for a 1-minute load average under 1.0-1.2, load after in brackets; steps 602, 296 pairs):
    writer thread (before)      +1.6 ms (+2.1 %, s.e. 1.1 ms, 122 steps), +1.9 ms (+2.65 %,
                                s.e. 0.67 ms, 302 steps) (quiet box)
    writer process, SCHED_IDLE  +1.67 ms (+2.31 %, s.e. 1.33 %; trimmed +2.24 %) of 72.4 ms (1.8)
                                +3.49 ms (+5.48 %, s.e. 1.28 %; trimmed +4.43 %) of 63.7 ms (1.9)
    writer thread, same session +3.09 ms (+4.65 %, s.e. 1.29 %; trimmed +3.40 %) of 66.6 ms (2.0)
    writer process, nice 19     +3.15 ms (+4.59 %, s.e. 1.33 %; median +1.47 ms) of 68.7 ms (2.1)
    hand-off only (the process discards each step)
                                +1.48 ms (+2.00 %, s.e. 1.16 %; trimmed +0.84 %) of 73.7 ms (1.9)
  After the cuts (a file per ~10 s of steps, not per step; the fast tokenizer's own decode; no
  garbage collector in the writer; trainer log-probs riding on the training step's reply; numpy
  log-probs in the hand-off); load before -> after in brackets:
    1202 steps, 596 pairs       +1.50 ms (+1.97 %, s.e. 0.85 %; trimmed +1.14 ms, +1.50 %,
                                s.e. 0.55 %) of 76.2 ms (0.4 -> 1.8)
    2402 steps, 1196 pairs      +3.40 ms (+3.22 %, s.e. 4.29 %: bursts of other jobs, steps of
                                105.7 ms on average; trimmed +1.36 ms, +1.29 %, s.e. 0.34 %;
                                median +1.19 ms) (1.2 -> 2.4)
    same, decode one segment    +0.63 ms (+0.78 %, s.e. 0.64 %; trimmed +0.43 ms, +0.54 %,
    at a time (no rayon)        s.e. 0.39 %; median +0.34 ms) of 80.6 ms (1.1 -> 2.6)
    hand-off only (the process  +0.88 ms (+1.12 %, s.e. 1.00 %; trimmed +0.15 ms, +0.19 %,
    discards each step)         s.e. 0.38 %; median +0.09 ms) of 78.4 ms (1.2 -> 2.5)
    the same cuts in a plain    +1.61 ms (+1.74 %, s.e. 0.67 %; trimmed +1.01 ms, +1.09 %,
    thread of the loop          s.e. 0.47 %; median +0.50 ms) of 92.6 ms (1.2 -> 2.2)
    nothing saved (A/A: the    -0.52 ms (-0.58 %, s.e. 0.83 %; trimmed -0.17 ms, -0.19 %,
    bench's own bias)           s.e. 0.41 %; median -0.42 ms) of 90.0 ms (1.2 -> 2.3)
  CPU per saved step: writer 1.1-1.4 ms (unpickle 0.3-0.5, rows + decode 0.5-0.6, Parquet with
  ~60 steps a file 0.3: was ~1.2 with a file per step, zstd ~0.01 of it), hand-off 0.19 ms;
  0.5 KiB of Parquet per saved step (7.5 KiB with a file per step).
  Runs during other jobs' bursts (steps of 160-300 ms) gave s.e. of 5-11 % and are left out.
  The hand-off alone costs ~0.2 %: what is left is the writer's CPU, which reaches the loop's
  steps even at SCHED_IDLE on this 2-core box. A thread costs the same within the noise here, but
  it holds the loop's GIL for all of that work (long rollouts: much more than here) and a killed
  loop loses its unwritten steps, so the writer stays a process.
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from molt_core.run import trajectory_store
from molt_core.cli import load
from molt_core.run.metrics import configure_logging
from molt_core.trainer import train


def cpu_ms(fn, n: int = 50) -> float:
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n * 1000


def main() -> None:
    recipe = sys.argv[1] if len(sys.argv) > 1 else "recipes/cpu/next_letter.yaml"
    overrides = ["trainer.steps=602", "check.consistency_every=0", "log.trajectories_every=2",
                 *sys.argv[2:]]
    configure_logging("WARNING")
    sync_s: list[float] = []
    last: list = []
    write = trajectory_store.TrajectoryWriter.write

    def timed_write(self, step, trajs, policy=None):
        t = time.perf_counter()
        write(self, step, trajs, policy)
        sync_s.append(time.perf_counter() - t)
        last[:] = [step, trajs]
    trajectory_store.TrajectoryWriter.write = timed_write
    cfg, plugins = load(recipe, overrides)
    run_dir = Path(tempfile.mkdtemp(prefix="molt-bench-"))
    load_before = os.getloadavg()
    steps = [h["time/step_s"] for h in train(cfg, plugins, run_dir, progress=False)][10:]
    load_after = os.getloadavg()
    # even steps (saved) have the synchronous part; odd ones run beside the writer process
    diffs = [steps[i + 1] - steps[i] for i in range(0, len(steps) - 1, 2)]
    base = statistics.mean(steps[0::2])
    sync = statistics.mean(sync_s[10::2])         # write() on saved (even) steps only
    files = list((run_dir / "trajectories").glob("*.parquet"))
    overhead = statistics.mean(diffs) + sync
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    print(f"{cfg.rollout.groups_per_step}x{cfg.rollout.group_size} rollouts per step, "
          f"{len(diffs)} step pairs after warm-up; mean step {base * 1000:.1f} ms; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"  loop's synchronous part   {sync * 1000:8.2f} ms  ({sync / base:.2%} of a step)")
    print(f"  step beside the writer    {statistics.mean(diffs) * 1000:+8.2f} ms  "
          f"(paired; s.e. {se * 1000:.2f} ms)")
    print(f"  saving every step adds    {overhead * 1000:+8.2f} ms  ({overhead / base:+.2%}, "
          f"s.e. {se / base:.2%})")
    cut = len(diffs) // 10        # load spikes from other jobs land on either side of a pair
    kept = sorted(diffs)[cut:len(diffs) - cut]
    wins = [min(max(d, kept[0]), kept[-1]) for d in diffs]      # its s.e.: winsorized spread
    trimmed = statistics.mean(kept) + sync
    trimmed_se = statistics.stdev(wins) / (len(kept) / len(diffs)) / len(diffs) ** 0.5
    print(f"  robust to load spikes     {trimmed * 1000:+8.2f} ms  ({trimmed / base:+.2%}, s.e. "
          f"{trimmed_se / base:.2%}; paired differences 10 % trimmed each side; median "
          f"{statistics.median(diffs) * 1000:+.2f} ms)")
    # the work of one saved step, timed here (CPU time) on the last step's trajectories
    step, trajs = last
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    lp = torch.zeros(sum(len(t.split_segments()) for t in trajs), max(len(t) for t in trajs))
    blob = pickle.dumps((step, trajs, {}, lp.numpy()), protocol=5)
    saved = len(sync_s[::2])
    per_file = saved / max(len(files), 1)
    rows = trajectory_store.trajectory_rows(step, trajs, tokenizer, lp) * round(per_file)
    tmp = Path(tempfile.mkdtemp(prefix="molt-bench-"))
    hand_off = cpu_ms(lambda: pickle.dumps((step, trajs, {}, lp.numpy()), protocol=5))
    load_ms = cpu_ms(lambda: pickle.loads(blob))
    rows_ms = cpu_ms(lambda: trajectory_store.trajectory_rows(step, trajs, tokenizer, lp))
    parquet_ms = cpu_ms(lambda: trajectory_store.write_trajectories(tmp / "x.parquet", rows),
                        5) / round(per_file)
    print(f"  hand-off in the loop      {hand_off:8.2f} ms CPU per saved step (pickling it)")
    writer_ms = load_ms + rows_ms + parquet_ms
    print(f"  writer process            {writer_ms:8.2f} ms CPU per saved step "
          f"(unpickle {load_ms:.2f}, rows + decode {rows_ms:.2f}, parquet {parquet_ms:.2f} with "
          f"{per_file:.0f} steps a file)")
    size = sum(f.stat().st_size for f in files) / saved
    print(f"  file size                 {size / 1024:8.1f} KiB per saved step ({len(files)} files)")


if __name__ == "__main__":
    main()
