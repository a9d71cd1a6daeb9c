"""The learning run on a real model: SmolLM2-135M-Instruct on held-out arithmetic word problems,
or (`--workload reasoning_gym`) on reasoning-gym's basic_arithmetic
(recipes/cpu/smollm2_reasoning_gym.yaml).

    python bench/smollm2.py [--full] [--workload arithmetic|reasoning_gym] [key=value ...]
    (make bench-smollm2; needs make pretrained)

LoRA r=16 (the recipe's lr) by default, `--full`: full fine-tuning (lr 2e-5). Prints held-out greedy
accuracy at every evaluation, steps and minutes of training (evaluations excluded), the trainer's
peak memory, the step-time breakdown and the trainer's achieved FLOP/s (6 x params x trained
tokens per second for full fine-tuning, the forward+backward cost a dense step pays; LoRA's
backward skips the frozen weights' gradients, so it does less) against a plain fp32 matmul on
one thread.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from molt_core.cli import load
from molt_core.run.metrics import configure_logging
from molt_core.trainer import train

WORKLOADS = {"arithmetic": "recipes/cpu/smollm2_arithmetic.yaml",
             "reasoning_gym": "recipes/cpu/smollm2_reasoning_gym.yaml"}


def matmul_flops(n: int = 1024, seconds: float = 2.0) -> float:
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        done += 1
    return 2 * n**3 * done / (time.perf_counter() - t0)


def main() -> None:
    args = sys.argv[1:]
    full = "--full" in args
    workload = args[args.index("--workload") + 1] if "--workload" in args else "arithmetic"
    overrides = [a for a in args if a not in ("--full", "--workload", workload)]
    if workload not in WORKLOADS:
        sys.exit(f"--workload {workload}: use one of {', '.join(WORKLOADS)}")
    if full:
        overrides = ["trainer.lora.rank=0", "trainer.lr=2e-5", *overrides]
    configure_logging()
    cfg, plugins = load(WORKLOADS[workload], overrides)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    history = train(cfg, plugins, None, progress=False)
    wall = time.perf_counter() - t0
    steps = [h for h in history if "reward/mean" in h]
    evals = [h for h in history if "eval/time_s" in h]
    eval_s = sum(e["eval/time_s"] for e in evals)
    train_s = sum(h["time/step_s"] for h in steps)
    params = 134.5e6
    tokens = [h["response/len_mean"] * h["rollout/trajectories"] for h in steps]
    fwd_bwd = sum(h["train/fwd_bwd_s"] for h in steps)
    flops = 6 * params * sum(tokens) / fwd_bwd  # trained tokens only (the prompt adds more)
    mm = matmul_flops()
    parts = {"generation": "time/generate_s", "train fwd/bwd": "train/fwd_bwd_s",
             "optimizer": "train/optim_s", "weight sync": "time/weight_sync_s"}
    step = statistics.mean(h["time/step_s"] for h in steps)
    out = {
        "workload": workload, "mode": "full" if full else f"lora r={cfg.trainer.lora.rank}",
        "engine": cfg.engine.name, "lr": cfg.trainer.lr, "steps": len(steps),
        "greedy_acc": {e["step"]: round(e["eval/greedy/pass@1"], 3) for e in evals},
        "sampled_pass@1": {e["step"]: round(e.get("eval/sampled/pass@1", float("nan")), 3)
                           for e in evals},
        "train_minutes": round(train_s / 60, 2), "eval_minutes": round(eval_s / 60, 2),
        "wall_minutes": round(wall / 60, 2), "mean_step_s": round(step, 2),
        "breakdown": {k: round(statistics.mean(h.get(v, 0.0) for h in steps) / step, 3)
                      for k, v in parts.items()},
        "trainer_peak_gib": round(max(h["memory/trainer_peak_gib"] for h in steps), 2),
        "reward_first_last": [round(steps[0]["reward/mean"], 3),
                              round(steps[-1]["reward/mean"], 3)],
        "trainer_gflops": round(flops / 1e9, 2), "matmul_gflops_1thread": round(mm / 1e9, 2),
        "prompts": f"{cfg.rollout.groups_per_step}x{cfg.rollout.group_size}",
        "eval_prompts": cfg.eval.prompts,
        "load_1min_start_end": [round(load0, 1), round(os.getloadavg()[0], 1)],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
