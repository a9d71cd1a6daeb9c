"""Steps/s of the sync, async and partial rollout schemes on the CPU recipe, side by side.

Generation is made comparable to training by letting responses run long (`sampling.
max_new_tokens`, no early stop beyond the model's own EOS) so each step's rollout costs about what
its optimizer step costs. All three runs share one local Ray (one process tree), one after the
other, same seed and model. Numbers, not pass/fail.
On the 2-core CI box, idle (2026-11-30): 16 tokens, 20 steps gave sync 3.25 steps/s, async 4.87
(1.50x), partial 4.84 (1.49x); 24 tokens 1.31x/1.29x (generation then dominates the step); 12 tokens
1.40x/1.24x. The engine and the trainer each hold one core, so the driver (agents, collate,
estimator) competes with them for CPU: expect more on a machine with spare cores.
2026-12-01 (load ~1, faster generation since): 20 steps sync 6.52 steps/s, async 0.99x, partial
0.99x; 40 steps async 7.93 / 8.39 and partial 7.81 / 8.22 steps/s with the trainer rank in the
driver's process (`trainer.in_driver`, the default) against async 7.69 / 7.76 and partial 7.12 /
7.46 with it as an actor (runs alternated).


    .venv/bin/python bench/async_speedup.py [--steps 20] [--max-new-tokens 16] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import ray
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from molt_core.cli import load  # noqa: E402
from molt_tools.tiny import build_tiny_model  # noqa: E402
from molt_core.trainer import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--schemes", default="sync,async,partial")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="molt-bench-"))
    os.environ.setdefault("RAY_TMPDIR", str(tmp / "ray"))
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
    from molt_tools.tiny import CHARSET
    model = build_tiny_model(tmp / "chars", "qwen3", charset=CHARSET)
    data = yaml.safe_load(open(ROOT / "recipes/cpu/next_letter.yaml"))
    data["model"]["path"] = str(model)
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=os.environ["RAY_TMPDIR"])
    common = [f"trainer.steps={args.steps}", f"sampling.max_new_tokens={args.max_new_tokens}",
              "check.consistency_every=0", *args.overrides]
    results = {}
    try:
        for scheme in args.schemes.split(","):
            extra = [] if scheme == "sync" else [
                "algorithm.correction=tis", "rollout.max_staleness=1",
                f"rollout.scheme={scheme}"]
            cfg, plugins = load(str(recipe), common + extra)
            t0 = time.perf_counter()
            (tmp / scheme).mkdir()
            hist = train(cfg, plugins, tmp / scheme, progress=False)
            wall = time.perf_counter() - t0
            timed = hist[args.warmup:]
            step_s = sum(h["time/step_s"] for h in timed) / len(timed)
            results[scheme] = {
                "steps/s": 1 / step_s, "wall_s": wall,
                "generate_s": sum(h["time/generate_s"] for h in timed) / len(timed),
                "train_s": sum(h["time/train_s"] for h in timed) / len(timed),
                "sync_s": sum(h["time/weight_sync_s"] for h in timed) / len(timed),
                "lag": max(h.get("rollout/version_lag_mean", 0) for h in timed),
                "dropped": sum(v for k, v in hist[-1].items() if k.startswith("rollout/dropped/")),
            }
    finally:
        ray.shutdown()
    base = results.get("sync", {}).get("steps/s")
    print(f"\nCPU recipe, {args.steps} steps ({args.warmup} warm-up excluded), "
          f"max_new_tokens={args.max_new_tokens}, overrides={args.overrides}")
    print(f"{'scheme':8} {'steps/s':>8} {'speedup':>8} {'wait_gen_s':>10} {'train_s':>8} "
          f"{'sync_s':>7} {'lag_max':>7} {'dropped':>7}")
    for s, r in results.items():
        sp = f"{r['steps/s'] / base:.2f}x" if base else "-"
        print(f"{s:8} {r['steps/s']:8.2f} {sp:>8} {r['generate_s']:10.3f} {r['train_s']:8.3f} "
              f"{r['sync_s']:7.3f} {r['lag']:7.2f} {r['dropped']:7.0f}")


if __name__ == "__main__":
    main()
