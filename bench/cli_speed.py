"""Wall time of the `molt` commands a user runs to look around (no training), each in a fresh
process, median of 3 after a warm-up (target: under 1.5 s each on the 2-core CPU box).

    python bench/cli_speed.py [MODEL_DIR]     # MODEL_DIR: the recipe's model (default .cache/tiny-chars)

Measured 2026-12-02 (2 cores, other sessions' tests running beside it), before -> after issue 28:
--version 11.6 -> 0.29 s (entry-point metadata, no plugin import); -h 0.12 -> 0.09 s; plugins
11.6 -> 11.3 s, validate 12.4 -> 12-18 s, config 12.9 -> 12.3 s: still over the 1.5 s target, as
loading the plugins imports torch (2-3.7 s: estimators and molt_core.algos at module top),
transformers (~2-5 s: molt_core.multimodal, molt_chat) and ray (0.6-1.1 s: molt_rollout_partial).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPE = "recipes/cpu/next_letter.yaml"


def wall(argv: list[str], runs: int = 3) -> float:
    times = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "molt_tools", *argv], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise SystemExit(f"molt {' '.join(argv)} failed: {done.stderr[-2000:]}")
        if i:                                    # the first run warms the page cache
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    model = Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-chars")
    if not (model / "config.json").is_file():
        from molt_tools.tiny import CHARSET, build_tiny_model
        build_tiny_model(model, "qwen3", charset=CHARSET)
    recipe = [RECIPE, f"model.path={model}"]
    for argv in (["--version"], ["-h"], ["plugins"], ["validate", *recipe], ["config", *recipe]):
        print(f"molt {' '.join(argv):<60} {wall(argv):6.2f} s", flush=True)


if __name__ == "__main__":
    main()
