"""Wall time of the `molt` commands a user runs to look around (no training), each in a fresh
process, median of 3 after a warm-up (target: under 1.5 s each on the 2-core CPU box).

    python bench/cli_speed.py [MODEL_DIR]     # MODEL_DIR: the recipe's model (default .cache/tiny-chars)

Measured 2026-12-02 (2 cores, other sessions' tests running beside it), before -> after issue 28:
--version 11.6 -> 0.29 s (entry-point metadata, no plugin import); -h 0.12 -> 0.09 s; loading the
plugins without torch/transformers/FastAPI (molt_core.lazy, "module:Class" engines and trainer
backends, adapters importing their library where it is used): plugins 12.4 -> 0.79 s,
validate 11.7 -> 0.68 s, config 19.1 -> 1.03 s (this script at nice -10 beside a nice 5 training
run, load 2.2; CPU time 0.31 / 0.11 / 0.88 / 0.79 / 1.14 s).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPE = "recipes/cpu/next_letter.yaml"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wall(argv: list[str], runs: int = 3) -> tuple[float, float]:
    """Median (wall, CPU) seconds. The process is single-threaded until it imports torch, so on
    a loaded box its CPU time (user + sys) is what its wall time is on a quiet one."""
    times, cpus = [], []
    for i in range(runs + 1):
        t0, c0 = time.perf_counter(), _cpu()
        done = subprocess.run([sys.executable, "-m", "molt_tools", *argv], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise SystemExit(f"molt {' '.join(argv)} failed: {done.stderr[-2000:]}")
        if i:                                    # the first run warms the page cache
            times.append(time.perf_counter() - t0)
            cpus.append(_cpu() - c0)
    return statistics.median(times), statistics.median(cpus)


def main() -> None:
    model = Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-chars")
    if not (model / "config.json").is_file():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        from molt_tools.tiny import CHARSET, build_tiny_model
        build_tiny_model(model, "qwen3", charset=CHARSET)
    recipe = [RECIPE, f"model.path={model}"]
    for argv in (["--version"], ["-h"], ["plugins"], ["validate", *recipe], ["config", *recipe]):
        w, c = wall(argv)
        print(f"molt {' '.join(argv):<60} {w:6.2f} s wall {c:6.2f} s CPU", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
