"""GPU check of the scale path: `recipes/gpu/smoke-qwen3.yaml` (engine vllm + trainer backend
automodel sharing one GPU) on a random-init small Qwen3 built here (nothing downloaded). Prints
per step: step time, generated tokens/s and the max engine-vs-trainer log-prob gap on on-policy
tokens (fp32; the recipe fails a step above 0.01). Needs vllm and nemo-automodel installed.

    python bench/gpu_smoke.py [key=value ...]        # e.g. trainer.steps=10
"""

from __future__ import annotations

import statistics
import sys
import tempfile

from molt_core.cli import load
from molt_core.run.metrics import configure_logging
from molt_tools.tiny import CHARSET, build_tiny_model
from molt_core.trainer import train


def main() -> None:
    configure_logging()
    tmp = tempfile.mkdtemp(prefix="molt-smoke-")
    model = build_tiny_model(f"{tmp}/smoke-qwen3", "qwen3", hidden_size=256, num_layers=4,
                             charset=CHARSET)
    cfg, plugins = load("recipes/gpu/smoke-qwen3.yaml",
                        [f"model.path={model}", f"out_dir={tmp}/runs", *sys.argv[1:]])
    history = train(cfg, plugins, None, progress=False)
    print("step  step_s  gen_s  train_s  sync_s  tokens/s  max|lp_engine - lp_trainer|")
    for i, h in enumerate(history):
        tokens = h["rollout/trajectories"] * h["response/len_mean"]
        print(f"{i:4d}  {h['time/step_s']:6.2f}  {h['time/generate_s']:5.2f}  "
              f"{h['time/train_s']:7.2f}  {h['time/weight_sync_s']:6.2f}  "
              f"{tokens / h['time/generate_s']:8.0f}  {h.get('mismatch/max_abs', float('nan')):.2e}")
    warm = history[1:] or history
    print(f"median step {statistics.median(h['time/step_s'] for h in warm):.2f} s (after step 0), "
          f"max log-prob mismatch {max(h.get('mismatch/max_abs', 0.0) for h in history):.2e}")


if __name__ == "__main__":
    main()
