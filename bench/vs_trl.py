"""Molt against TRL's GRPOTrainer on the same model, task, prompts and batch geometry.

Each side runs in its own fresh process, one after the other (TRL from its own venv, `make
venv-trl`, since it pins its own stack): start-up, per-step time, generation time per step,
sampled tokens/s, and wall time from process launch until the mean reward of the last `--window`
steps first reaches each level. Printed as Molt/TRL ratios (< 1: Molt is faster). Numbers, not
pass/fail; the box load (`uptime`) is printed with them.

Workload `addition` (the default): a tiny random-init Qwen3 (hidden 64, 2 layers, byte-level BPE,
built locally), "what is 3 plus 4?" through the chat template, reward 1 when the reply starts with
the sum, 0.1 for another digit; 16 prompts x 32 samples per step, 4 new tokens, temperature 1,
lr 1e-3 constant, AdamW (0.9, 0.999), no weight decay, grad clip 1, no KL, entropy bonus 0.05,
token-mean loss over the whole batch (TRL `loss_type="dapo"`), rewards normalised by the group's
mean and std, one optimizer step per batch. Both sides see the same prompt sequence.

Semantic differences that remain:
- Molt's engine samples in its own decode loop and keeps the engine's log-probs as the behavior
  policy; TRL samples with `generate` and recomputes old log-probs with the trainer's forward
  (identical here: same fp32 weights, one step per batch, so the ratio is 1 on both sides).
- Molt stops at every stop id of the model's generation config (<|im_end|> and <|endoftext|>);
  TRL at the tokenizer's eos (<|im_end|>) only; the reward reads text before either.
- Molt runs engine and trainer as two Ray actors (weights pushed after every step); TRL
  generates with the model it trains, in one process.
- async: Molt samples up to one version behind (max_staleness 1) with a TIS correction; TRL has
  no asynchronous mode here, so async rows compare with TRL's (synchronous) run.

Measured 2026-12-01 on the shared 2-core box under load average 17-27 (other sessions' jobs),
--threads 1, 400 steps: per-step time Molt sync/TRL 0.22 (0.67 s vs 3.06 s), async 0.23;
generation per step 0.67x; time to a 10-step mean reward of 0.1: 0.50 (sync) and 0.50 (async),
of 0.2: 0.43 and 0.41 (async reached it before sync: 125 s vs 130 s; TRL 303 s); both reach a
final reward of ~0.27 (learning per step matches); start-up to the first step 3.4x TRL's (60 s
vs 18 s: Ray, two actor processes importing torch/transformers). 25 steps under load ~9: step
0.59x (sync), 0.87x (async).

    python bench/vs_trl.py [--steps 80] [--schemes sync,async] [--levels 0.3,0.5] [--window 10]
                           [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEOMETRY = {"prompts": 16, "samples": 32, "new_tokens": 4, "lr": 1e-3, "entropy_coef": 0.05}
WORKLOADS = {
    # name: (model directory, Molt recipe, env args); the TRL side reads the same prompts
    "addition": (".cache/tiny-qwen3", "recipes/cpu/addition.yaml", {"hi": 4}),
}


def addition_reward(text: str, a: int, b: int) -> float:
    """The `addition` env's reward (molt_gym.Addition), for the TRL side (no molt import)."""
    first = text.strip()[:1]
    return 1.0 if first == str(a + b) else 0.1 if first.isdigit() else 0.0


def tasks(seed: int, n: int, hi: int) -> list[tuple[int, int]]:
    """The operands of groups 0..n-1, as Molt's generator draws them (task = seed * 1000003 +
    group id, then molt_gym.Addition.reset)."""
    out = []
    for g in range(n):
        rng = random.Random(seed * 1_000_003 + g)
        out.append((rng.randint(0, hi), rng.randint(0, hi)))
    return out


# --- TRL side (runs in .venv-trl: no molt imports) ---------------------------------------------

def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    gen_s: list[float] = []
    log_metrics = profiling.ProfilingContext._log_metrics

    def record(self, duration):  # TRL times its generate call; keep it per step
        if self.name.endswith("transformers.generate"):
            gen_s.append(duration)
        return log_metrics(self, duration)
    profiling.ProfilingContext._log_metrics = record

    g = spec["geometry"]
    rows = [{"prompt": [{"role": "user", "content": f"what is {a} plus {b}?"}], "a": a, "b": b}
            for a, b in spec["tasks"]]

    def reward(completions, a, b, **_):
        return [addition_reward(c[0]["content"], x, y) for c, x, y in zip(completions, a, b)]

    steps: list[dict] = []

    class Stamp(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                steps.append({"t": time.time(), "reward": logs["reward"],
                              "gen_s": gen_s[-1] if gen_s else 0.0})

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    args = GRPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=g["prompts"] * g["samples"],
        num_generations=g["samples"], max_completion_length=g["new_tokens"], temperature=1.0,
        top_k=0, top_p=1.0, learning_rate=g["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, loss_type="dapo", beta=0.0,
        entropy_coef=g["entropy_coef"], scale_rewards="group", max_steps=spec["steps"],
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, shuffle_dataset=False,
        seed=spec["seed"], disable_tqdm=True, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list(rows), callbacks=[Stamp()])
    trainer.train()
    return {"steps": steps}


# --- Molt side ---------------------------------------------------------------------------------

def run_molt(spec: dict) -> dict:
    from molt_core import hookimpl
    from molt_core.cli import load
    from molt_core.trainer import train

    steps: list[dict] = []

    class Stamp:
        @hookimpl
        def molt_on_step_end(self, step, metrics):
            steps.append({"t": time.time(), "reward": metrics["reward/mean"],
                          "gen_s": metrics["time/generate_s"]})

    cfg, plugins = load(spec["recipe"], spec["overrides"])
    plugins.pm.register(Stamp())
    train(cfg, plugins, None, progress=False)
    return {"steps": steps}


# --- driver ------------------------------------------------------------------------------------

def launch(python: str, side: str, spec: dict, tmp: Path) -> dict:
    spec_path, out_path = tmp / f"{side}.spec.json", tmp / f"{side}.out.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.time()
    env = {**os.environ, "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", "/tmp/ray_vs_trl")}
    subprocess.run([python, __file__, "--worker", side, str(spec_path), str(out_path)],
                   check=True, cwd=ROOT, env=env)
    out = json.loads(out_path.read_text())
    out["launch"], out["wall"] = t0, time.time() - t0
    return out


def summary(run: dict, warmup: int, window: int, levels: list[float], tokens: int) -> dict:
    s = run["steps"]
    dts = [b["t"] - a["t"] for a, b in zip(s, s[1:])][warmup:]
    gens = [x["gen_s"] for x in s[warmup + 1:]]
    out = {"s to first step done": s[0]["t"] - run["launch"],
           "step s (median)": statistics.median(dts), "generation s (median)":
           statistics.median(gens), "tokens/s (sampled, median step)": tokens /
           statistics.median(dts), "final reward": statistics.mean(
               x["reward"] for x in s[-window:])}
    for lv in levels:
        hit = next((s[i]["t"] - run["launch"] for i in range(window - 1, len(s))
                    if statistics.mean(x["reward"] for x in s[i - window + 1:i + 1]) >= lv),
                   None)
        out[f"s to reward {lv:g}"] = hit
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=3, metavar=("SIDE", "SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="addition", choices=sorted(WORKLOADS))
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of per-step medians")
    ap.add_argument("--window", type=int, default=10, help="steps in the reward mean")
    ap.add_argument("--levels", default="0.3,0.5")
    ap.add_argument("--schemes", default="sync,async")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads of TRL's process "
                    "and of each Molt actor (Molt: ray.num_cpus); 0: each side's default")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"))
    args = ap.parse_args()
    if args.worker:
        side, spec_path, out_path = args.worker
        spec = json.loads(Path(spec_path).read_text())
        out = run_trl(spec) if side == "trl" else run_molt(spec)
        Path(out_path).write_text(json.dumps(out))
        return

    import tempfile
    model_dir, recipe, env_args = WORKLOADS[args.workload]
    if not (ROOT / model_dir / "config.json").exists():
        from molt_tools.tiny import build_tiny_model
        build_tiny_model(ROOT / model_dir)
    g, levels = GEOMETRY, [float(x) for x in args.levels.split(",")]
    common = [f"model.path={model_dir}", f"seed={args.seed}", f"trainer.steps={args.steps}",
              f"rollout.groups_per_step={g['prompts']}", f"rollout.group_size={g['samples']}",
              f"sampling.max_new_tokens={g['new_tokens']}", f"trainer.lr={g['lr']}",
              f"algorithm.terms.entropy_coef={g['entropy_coef']}", "check.consistency_every=0"] + ([f"ray.num_cpus={args.threads}"] if args.threads else [])
    scheme_args = {"sync": ["rollout.scheme=sync"],
                   "async": ["rollout.scheme=async", "rollout.max_staleness=1",
                             "algorithm.correction=tis"]}
    tokens = g["prompts"] * g["samples"] * g["new_tokens"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        trl_spec = {"model": str(ROOT / model_dir), "steps": args.steps, "seed": args.seed,
                    "threads": args.threads,
                    "geometry": g, "out_dir": tmp + "/trl",
                    "tasks": tasks(args.seed, args.steps * g["prompts"], env_args["hi"])}
        results["trl"] = launch(args.trl_python, "trl", trl_spec, Path(tmp))
        for scheme in args.schemes.split(","):
            spec = {"recipe": recipe, "overrides": common + scheme_args[scheme]}
            results[f"molt {scheme}"] = launch(sys.executable, "molt", spec, Path(tmp))
    rows = {k: summary(v, args.warmup, args.window, levels, tokens) for k, v in results.items()}
    load = os.getloadavg()
    print(f"\n{args.workload}: {g['prompts']}x{g['samples']} samples, {g['new_tokens']} new tokens,"
          f" {args.steps} steps; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    names = list(rows)
    print(f"{'':34}" + "".join(f"{n:>14}" for n in names)
          + "".join(f"{n + '/trl':>18}" for n in names[1:]))
    for key in rows["trl"]:
        vals = [rows[n][key] for n in names]
        cells = "".join(f"{'-' if v is None else f'{v:.3f}':>14}" for v in vals)
        ratios = "".join(f"{'-' if not (v and vals[0]) else f'{v / vals[0]:.2f}':>18}"
                         for v in vals[1:])
        print(f"{key:34}{cells}{ratios}")


if __name__ == "__main__":
    main()
