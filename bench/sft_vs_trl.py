"""`molt sft` against TRL's SFTTrainer on identical tokens, weights and optimizer (issue 42,
acceptance 3).

Each side runs in a fresh process of its own, one after the other (`--rounds` alternates them):
Molt's `molt_core.sft_trainer.sft` in this venv, TRL's `SFTTrainer` in `.venv-trl` (`make
venv-trl`) through bench/_trl_sft.py, which imports no Molt. What makes the two runs the same run:

- rows: multi-turn calculator tool transcripts (a user question, an assistant tool call, the
  tool's result, the assistant's answer; `tools=` listed by recipes/templates/smollm2_tools.jinja)
  written as chat JSONL; Molt renders them (the chat server's rendering, assistant tokens
  trainable) and the bench records the very token ids and loss masks each of Molt's steps
  trained on, in its order; TRL gets those as a pre-tokenized dataset (`input_ids` +
  `completion_mask`, `completion_only_loss`) read in order (sequential sampler, no packing, no
  truncation). Both sides train on the same tokens of the same rows in the same steps.
- weights: the model in fp32 (`model.dtype=float32`, TRL bf16 off), LoRA with the same rank,
  alpha, dropout 0 and target modules (every Linear but the head); the adapters start from the
  same tensors: Molt's initial A and B are saved as its trainer builds them and copied into TRL's
  PEFT model before its first step.
- optimizer: AdamW with the same lr, betas, eps, weight decay, constant lr without warmup, grad
  clip; one optimizer step per batch of `--batch` rows, micro-batches of `--micro` rows (TRL:
  gradient accumulation), the loss the mean NLL over the batch's trainable tokens on both (HF's
  Trainer divides each micro-batch's summed loss by the batch's token count,
  `num_items_in_batch`; Molt's token-mean by the step's global count).
- no gradient checkpointing on either side (TRL's default would recompute the forward), no
  checkpoints saved during the run, the same intra-op threads (`--threads`).

Measured per step: the loss and grad norm each side reports, the wall time between consecutive
step ends and the process CPU time over it (the box is shared: CPU time is the steadier number),
medians over the steps after the first; peak RSS of each process. Printed: the loss curves side
by side with |diff|, the tolerance check (`--tol`: max |loss diff| over the steps), Molt / TRL
ratios.

Measured 2026-12-07 (docs/benchmarks.md, "SFT: molt sft vs TRL's SFTTrainer"), SmolLM2-135M-
Instruct with the defaults, after `_trunk` runs the prefix every row shares once (a186596), load
average 5.7-13 on the 2 shared cores: CPU per step 5.94 s (Molt) vs 13.99 s (TRL), 0.42x (wall
12.1 vs 21.2 s, 0.57x: Molt's steps ran at the higher load); loss max |diff| 4.3e-5 over the 8
steps, grad norms within 3.2e-4 relative; peak RSS 2.44 vs 3.59 GiB. Before it: 5.68 / 5.86 vs
9.51 CPU s (0.60-0.62x), max |diff| 4.2e-5. On a shared box judge by CPU seconds, and alternate
the sides (`--rounds 2`).
Tiny Qwen3 (`--model tiny`, 6 steps, micro 4 of 8, 2 threads): max |diff| 4.8e-7.

    python bench/sft_vs_trl.py [--model DIR|tiny] [--steps 8] [--batch 4] [--micro 4] [--rows 40]
                               [--lr 2e-3] [--rank 16] [--alpha 32] [--threads 1] [--rounds 1]
                               [--tol 1e-3] [--json out.json] [--trl-json earlier.json]
    make bench-sft-trl            (make pretrained and make venv-trl first)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "recipes/templates/smollm2_tools.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 12 * 34",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
QUESTIONS = ["What is {e}?", "Compute {e}.", "Please work out {e} for me.",
             "I need the value of {e}, can you help?", "How much is {e}? Use the calculator.",
             "My homework asks for {e}. What do I write down?"]
ANSWERS = ["{e} = {r}", "The answer is {r}.", "{e} is {r}.", "It comes to {r}."]


def transcripts(n: int, seed: int) -> list[dict]:
    """`n` chat rows: question, tool call, tool result, answer (two assistant turns each)."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        a, b, op = rng.randint(10, 9999), rng.randint(2, 999), rng.choice("+-*")
        e = f"{a} {op} {b}"
        r = a + b if op == "+" else a - b if op == "-" else a * b
        call = {"id": f"call_{i}", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": e})}}
        rows.append({"tools": TOOLS, "messages": [
            {"role": "user", "content": rng.choice(QUESTIONS).format(e=e)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": str(r)},
            {"role": "assistant", "content": rng.choice(ANSWERS).format(e=e, r=r)}]})
    return rows


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# --- Molt side (this venv) -----------------------------------------------------------------------

def run_molt(spec: dict) -> dict:
    """`molt_core.sft` on the spec's rows; writes the initial adapters and the trained rows."""
    import torch
    from safetensors.torch import save_file

    from molt_core import hookimpl, lora, sft_trainer
    from molt_core.cli import load

    add_adapters, batch = lora.add_adapters, sft_trainer._batch
    trained: list[list[dict]] = []

    def saving_adapters(model, cfg):        # the initial A and B, as the trainer made them
        model = add_adapters(model, cfg)
        save_file({n: p.detach().clone().contiguous() for n, p in model.named_parameters()
                   if p.requires_grad}, spec["adapter"])
        return model

    def recording(rows, pad):               # the tokens and masks each step trains on
        trained.append([{"input_ids": list(t.token_ids),
                         "completion_mask": [int(m) for m in t.loss_mask]} for t in rows])
        return batch(rows, pad)
    lora.add_adapters, sft_trainer._batch = saving_adapters, recording

    steps: list[dict] = []

    class Stamp:
        @hookimpl
        def molt_on_step_end(self, step, metrics):
            steps.append({"t": time.time(), "cpu": _cpu(), "loss": metrics["train/loss"],
                          "grad_norm": metrics.get("train/grad_norm"),
                          **{k: metrics.get(k) for k in ("time/step_s", "train/fwd_bwd_s",
                                                         "train/optim_s")}})

    try:
        cfg, plugins = load(None, spec["overrides"])
        plugins.pm.register(Stamp())
        sft_trainer.sft(cfg, plugins, None, progress=False)
    finally:                                # as it was (a test runs this in its process)
        lora.add_adapters, sft_trainer._batch = add_adapters, batch
    Path(spec["rows_out"]).write_text(json.dumps(trained))
    return {"steps": steps, "rss_gib": _peak_rss_gib(),
            "threads": torch.get_num_threads()}


def molt_overrides(a: argparse.Namespace, model: str, data: str) -> list[str]:
    return [f"model.path={model}", f"model.chat_template={TEMPLATE}", "model.dtype=float32",
            f"seed={a.seed}", f"ray.num_cpus={a.threads}", "trainer.backend=fsdp2",
            "trainer.num_ranks=1", f"trainer.lr={a.lr}", "trainer.lr_schedule=constant",
            "trainer.warmup_steps=0", f"trainer.weight_decay={a.weight_decay}",
            "trainer.betas=[0.9,0.999]", "trainer.eps=1e-8", f"trainer.grad_clip={a.grad_clip}",
            f"trainer.micro_batch_size={a.micro}", f"trainer.lora.rank={a.rank}",
            f"trainer.lora.alpha={a.alpha}", "trainer.lora.dropout=0.0",
            "trainer.lora.target_modules=all-linear", f"sft.data={data}",
            f"sft.steps={a.steps}", f"sft.batch_size={a.batch}", "sft.eval_fraction=0.0",
            "sft.max_tokens=2048", "log.trajectories_every=0",
            # unused by `molt sft` (no greedy eval here), but a config names an agent
            f"agent.args={{env: math, env_args: {{data: {data}}}}}"]


# --- driver --------------------------------------------------------------------------------------

def molt_spec(a: argparse.Namespace, model: str, data: Path, tmp: Path) -> dict:
    """`run_molt`'s spec: it writes the initial adapters and the trained rows into `tmp`."""
    return {"overrides": molt_overrides(a, model, str(data)), "adapter": str(tmp / "init.st"),
            "rows_out": str(tmp / "rows.json")}


def trl_spec(a: argparse.Namespace, model: str, tmp: Path) -> dict:
    """bench/_trl_sft.py's spec: the rows and adapters `run_molt` wrote, Molt's settings."""
    return {"model": model, "rows": str(tmp / "rows.json"), "adapter": str(tmp / "init.st"),
            "steps": a.steps, "batch": a.batch, "micro": a.micro, "lr": a.lr,
            "weight_decay": a.weight_decay, "grad_clip": a.grad_clip, "rank": a.rank,
            "alpha": a.alpha, "seed": a.seed, "threads": a.threads,
            "out_dir": str(tmp / "trl-out"), "out": str(tmp / "trl.out.json")}


def run_trl(python: str, spec: dict) -> dict:
    path = Path(spec["out"]).with_suffix(".spec.json")
    path.write_text(json.dumps(spec))
    return launch(python, [str(ROOT / "bench/_trl_sft.py"), str(path)], Path(spec["out"]))


def launch(python: str, args: list[str], out: Path) -> dict:
    t0 = time.time()
    subprocess.run([python, *args], check=True, cwd=ROOT, env={
        **os.environ, "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", "/tmp/ray-sft-vs-trl"),
        "TOKENIZERS_PARALLELISM": "false"})
    res = json.loads(out.read_text())
    res["launch"], res["wall"] = t0, time.time() - t0
    return res


def per_step(run: dict) -> dict:
    """Medians over the steps after the first: wall time between step ends and CPU time."""
    s = run["steps"]
    dt = [b["t"] - a["t"] for a, b in zip(s, s[1:])]
    dc = [b["cpu"] - a["cpu"] for a, b in zip(s, s[1:])]
    return {"step s (median)": statistics.median(dt), "step CPU s (median)": statistics.median(dc),
            "launch to step 1 done s": s[0]["t"] - run["launch"], "peak RSS GiB": run["rss_gib"],
            "process wall s": run["wall"]}


def tiny_model() -> str:
    path = ROOT / ".cache/tiny-qwen3-sft"
    if not (path / "config.json").exists():
        from molt_tools.tiny import build_tiny_model
        build_tiny_model(path, "qwen3", extra_corpus=[json.dumps(r) for r in transcripts(64, 1)])
    return str(path)


def compare(a: argparse.Namespace) -> dict:
    """Run both sides (`a.rounds` times each, alternating) and return the measurements."""
    model = tiny_model() if a.model == "tiny" else str(Path(a.model).resolve())
    if not (Path(model) / "config.json").exists():
        raise SystemExit(f"{model} is missing: make pretrained")
    if not (a.trl_json or Path(a.trl_python).exists()):
        raise SystemExit(f"{a.trl_python} is missing: make venv-trl")
    tmp = Path(tempfile.mkdtemp(prefix="sft-vs-trl-"))
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in transcripts(a.rows, a.seed)))
    runs: dict[str, list[dict]] = {"molt": [], "trl": []}
    for r in range(a.rounds):
        spec, out = tmp / "molt.spec.json", tmp / "molt.out.json"
        spec.write_text(json.dumps(molt_spec(a, model, data, tmp)))
        runs["molt"].append(launch(sys.executable, [__file__, "--worker", str(spec), str(out)],
                                   out))
        if not a.trl_json:
            runs["trl"].append(run_trl(a.trl_python, trl_spec(a, model, tmp)))
    rows = json.loads((tmp / "rows.json").read_text())
    if a.trl_json:                  # TRL's runs of an earlier --json, on these very rows
        earlier = json.loads(Path(a.trl_json).read_text())
        if earlier["rows"] != rows:
            raise SystemExit(f"{a.trl_json} trained TRL on other rows than Molt's now (another "
                             "rendering, data or settings): run both sides")
        runs["trl"] = earlier["runs"]["trl"]
    return {"model": model, "runs": runs, "rows": rows,
            "tokens": [sum(len(x["input_ids"]) for x in s) for s in rows],
            "trained_tokens": [sum(sum(x["completion_mask"]) for x in s) for s in rows]}


def report(a: argparse.Namespace, res: dict) -> dict:
    m, t = res["runs"]["molt"][0]["steps"], res["runs"]["trl"][0]["steps"]
    if len(m) != len(t):
        raise SystemExit(f"Molt ran {len(m)} steps, TRL {len(t)}")
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(m, t)]
    load = os.getloadavg()
    tokens, trained = (statistics.mean(res[k]) for k in ("tokens", "trained_tokens"))
    print(f"\n{Path(res['model']).name}: {a.steps} steps of {a.batch} rows (micro {a.micro}), "
          f"LoRA r{a.rank} alpha {a.alpha:g}, lr {a.lr:g}, fp32, {a.threads} threads; tokens "
          f"per step {tokens:.0f} ({trained:.0f} trained); load average {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}")
    print(f"{'step':>4} {'molt loss':>10} {'trl loss':>10} {'|diff|':>9} {'molt gnorm':>10} "
          f"{'trl gnorm':>10}")
    for i, (x, y) in enumerate(zip(m, t)):
        print(f"{i:>4} {x['loss']:10.5f} {y['loss']:10.5f} {diffs[i]:9.2e} "
              f"{x['grad_norm'] or 0:10.5f} {y['grad_norm'] or 0:10.5f}")
    sides = {k: [per_step(r) for r in v] for k, v in res["runs"].items()}
    table = {k: {q: statistics.median(r[q] for r in v) for q in v[0]} for k, v in sides.items()}
    print(f"\n{'':24}{'molt':>12}{'trl':>12}{'molt/trl':>10}")
    for q in table["molt"]:
        x, y = table["molt"][q], table["trl"][q]
        print(f"{q:24}{x:12.3f}{y:12.3f}{x / y:10.2f}")
    ok = max(diffs) <= a.tol
    ratio, cpu = (table["molt"][q] / table["trl"][q] for q in ("step s (median)",
                                                               "step CPU s (median)"))
    print(f"\nloss curves: max |diff| {max(diffs):.2e} at step {diffs.index(max(diffs))} "
          f"(first step {diffs[0]:.2e}), tolerance {a.tol:g}: {'ok' if ok else 'EXCEEDED'}; "
          f"median step molt/trl {ratio:.2f} wall, {cpu:.2f} CPU (issue 42's bound: 0.5)")
    return {"table": table, "max_diff": max(diffs), "diffs": diffs, "ratio": ratio,
            "cpu_ratio": cpu, "load": load, "within_tol": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--model", default=str(ROOT / ".cache/smollm2-135m-instruct"),
                    help="HF model directory, or tiny (a random-init tiny Qwen3, built here)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="rows per optimizer step")
    ap.add_argument("--micro", type=int, default=4, help="rows per forward/backward")
    ap.add_argument("--rows", type=int, default=40, help="transcripts written")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of each side (one: "
                    "no OpenMP spin in the CPU times of a loaded box)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating")
    ap.add_argument("--tol", type=float, default=1e-3, help="max |loss diff| at any step")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"))
    ap.add_argument("--json", default="", help="write the raw runs and the summary here")
    ap.add_argument("--trl-json", default="", help="take TRL's side from this earlier --json "
                    "(same settings) instead of running it: a Molt change against the same TRL run")
    a = ap.parse_args()
    if a.worker:
        spec = json.loads(Path(a.worker[0]).read_text())
        Path(a.worker[1]).write_text(json.dumps(run_molt(spec)))
        return
    res = compare(a)
    out = report(a, res)
    if a.json:
        Path(a.json).write_text(json.dumps({**res, **out}, indent=1))
    if not out["within_tol"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
