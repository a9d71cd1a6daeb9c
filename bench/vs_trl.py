"""Molt against TRL's GRPOTrainer on the same model, task, prompts and batch geometry.

Each side runs in its own fresh process, one after the other (TRL from its own venv, `make
venv-trl`, since it pins its own stack): start-up, per-step time, generation time per step and
its share, sampled tokens/s, peak RSS, and wall time from process launch (held-out evaluations
excluded) until the mean reward of the last `--window` steps, or the held-out greedy accuracy,
first reaches each level. Printed as Molt/TRL ratios (< 1: Molt is faster). Numbers, not
pass/fail; the box load is printed with them. The trainer's GFLOP/s on trained tokens is also
printed against the bf16 matmul bound taken beside each side's run (`beside`), per thread count:
read the row of the trainer's threads (Molt sync: all cores; async: one).

Both sides read one config: the workload's Molt recipe plus the command line's `key=value`
overrides (lr, steps, geometry, LoRA, eval). The prompts are made once, in Molt's venv, by the
recipe's gym env on the tasks Molt's generator draws (task = seed * 1000003 + group id; held-out
task EVAL_TASKS + i), and handed to TRL in that order (`shuffle_dataset=False`).

Workload `addition` (the default): a tiny random-init Qwen3 (hidden 64, 2 layers, byte-level BPE,
built locally), "what is 3 plus 4?" through the chat template, reward 1 when the reply starts with
the sum, 0.1 for another digit; 16 prompts x 32 samples per step, 4 new tokens, temperature 1,
lr 1e-3 constant, AdamW (0.9, 0.999), no weight decay, grad clip 1, no KL, entropy bonus 0.05,
token-mean loss over the whole batch (TRL `loss_type="dapo"`), rewards normalised by the group's
mean and std, one optimizer step per batch.

Workload `addition-system`: the same, behind a 44-word system message (instructions, as agent
prompts carry instructions and tool descriptions): 139 prompt tokens instead of 20, so a group's
32 rows share 139 of their 143 tokens. Molt's engine prefills a group's prompt once and its
one-rank trainer runs it once per group; TRL's `generate` and forward run every row whole.

Workload `smollm2` (recipes/cpu/smollm2_arithmetic.yaml, `make pretrained` first): the converted
SmolLM2-135M-Instruct on one-operation arithmetic word problems (+ and -, operands 2-30, split
train; held-out: `eval.prompts` problems of split test), system message "Answer with just the
final number.", its own chat template, LoRA r=16 alpha 32 dropout 0 on every linear layer but the
head, lr 1e-4 constant (the recipe's), 4 prompts x 8 samples, 16 new tokens, T=1, reward
math-verify on the reply against the answer (the same parse/verify calls as molt_reward_math,
no \\boxed needed), AdamW/clip/loss/normalisation as above, no entropy bonus; greedy pass@1 on the
held-out problems before training, every `eval.every` steps and at the end (Molt: `eval.k=0`,
greedy only).

Semantic differences that remain:
- Molt's engine samples in its own decode loop and keeps the engine's log-probs as the behavior
  policy; TRL samples with `generate` and recomputes old log-probs with the trainer's forward
  (identical here: same fp32 weights, one step per batch, so the ratio is 1 on both sides).
- `addition`: Molt stops at every stop id of the model's generation config (<|im_end|> and
  <|endoftext|>); TRL at the tokenizer's eos (<|im_end|>) only; the reward reads text before
  either. `smollm2`: both stop at <|im_end|> only.
- Molt runs engine and trainer as two Ray actors (weights pushed after every step; with LoRA the
  merged weights); TRL generates with the model it trains, in one process (with LoRA: through the
  unmerged adapters).
- Group std: Molt divides by (std + 1e-6), TRL by (std + 1e-4); both unbiased.
- Held-out greedy: Molt's engine decodes each prompt with top_k 1; TRL's side runs one batched,
  left-padded `generate(do_sample=False)` over all held-out prompts (argmax either way; padding
  may move fp32 rounding).
- async (`addition` only): Molt samples up to one version behind (max_staleness 1) with a TIS
  correction; TRL has no asynchronous mode here, so async rows compare with TRL's synchronous run.
- TRL computes in the recipe's `model.dtype` over fp32 weights, like Molt: `bf16=True` (bf16
  autocast, TRL's default) where the recipe says bfloat16, else fp32; no gradient checkpointing
  on either side (TRL's default has it).
- Molt runs a group's shared prompt once (engine prefill, trainer forward); TRL runs every row
  whole. Same log-probs and gradients up to fp32 rounding.
- Peak RSS: each side's process tree (Molt: driver, Ray's daemons, trainer and engine actors),
  sampled every second; shared pages count once per process.

`addition-system`, measured 2026-12-01 14:40-15:14 (trainer batches crossing Ray as numpy), 200
steps, `--levels 0.1,0.15,0.2,0.25`, two runs at load average 1.7-2.5: median step 2.33 / 2.31 s
(TRL), 0.45 / 0.42 s (Molt sync, 0.19x / 0.18x), 0.41 / 0.36 s (async, 0.17x / 0.16x); generation
per step 0.47 / 0.45 s vs 0.17 / 0.16 s (sync, 0.37x / 0.36x); start-up to the first step done
10.6 / 7.7 s vs 15.9 / 14.9 s (sync) and 17.7 / 14.7 s (async); wall time from launch to a 10-step
mean reward of 0.1: 148 / 145 s vs 44 / 42 s (0.30x / 0.29x) and 43 / 38 s (0.29x / 0.27x), of 0.2:
223 / 216 s vs 55 / 53 s (0.25x / 0.24x) and 57 / 51 s (0.26x / 0.23x), of 0.25: 281 / 277 s vs 71
/ 67 s (0.25x / 0.24x) and 80 / 71 s (0.29x / 0.26x); final reward 0.25 on every side; both sides
reach 0.2 after ~90-100 steps. Async takes 10-15 % shorter steps than sync here but about the same
time to a reward: on 2 cores engine and trainer get one thread each while they overlap.

`addition` with the same code (one run, load 1.6-1.8; TRL's start-up was slow this time, 19.5 s
against 5-8 s in every other run): median step 0.43 s (TRL), 0.20 s (sync, 0.46x), 0.15 s (async,
0.34x); generation 0.069 s vs 0.089 s (sync, 1.29x); wall time to a mean reward of 0.2: 61 s vs
38 s (0.62x) and 29 s (0.46x).

`addition` now (the engine samples with torch.multinomial; Ray starts in a thread while the Molt
driver imports, `cluster.prestart`), measured 2026-12-01 12:16-12:28, 200 steps, `--levels
0.1,0.15,0.2`, two runs, each under the box's heavy-run lock but at load average 2.0-2.6 from
other sessions' jobs (not a quiet box): median step 0.36 / 0.38 s (TRL), 0.22 / 0.25 s (Molt
sync, 0.61x / 0.66x), 0.19 / 0.20 s (async, 0.52x / 0.54x); generation per step 0.058 / 0.065 s
vs 0.088 / 0.098 s (sync, 1.5x) and 0.009 s (async); start-up to the first step done 5.1 / 5.8 s
vs 12.2 / 11.7 s (sync, 2.4x / 2.0x) and 11.3 / 12.7 s (async); wall time from launch to a
10-step mean reward of 0.1: 29.8 / 30.7 s vs 26.5 / 27.5 s (0.89x / 0.89x) and 22.6 / 24.4 s
(0.76x / 0.79x), of 0.2: 41.5 / 43.9 s vs 33.9 / 35.1 s (0.82x / 0.80x) and 28.7 / 32.8 s (0.69x
/ 0.75x); final reward 0.25 on every side. Both sides reach 0.2 after ~100 steps, so a ratio of
0.5 needs shorter steps as well as a shorter start-up: at this load 100 Molt sync steps alone
take ~22 s of TRL's ~42 s. Start-up measured apart (launch to the first step done, 3
alternating runs each, load ~1.9): 15.8 s (16.3, 14.5, 16.7) with Ray started after the driver's
imports and a runtime_env, 11.2 s (11.0, 12.0, 10.7) with `prestart` and the environment
inherited instead (Ray's workers started ahead of the job then serve the actors). What is left
is CPU on 2 cores: the driver's imports (~3.5 s: torch, transformers' auto classes, which
`AutoTokenizer` pulls in too), Ray's daemons (~3 s: autoscaler monitor, dashboard head, log
monitor, dashboard agent, runtime-env agent) and each actor importing torch and transformers
(~3.7 s each). Preloading torch and transformers in Ray's prestarted workers
(`preload_python_modules`) gave nothing more: the cores are already busy.

`addition` before (inverse-CDF draw, Ray started after the driver's imports), measured 2026-12-01
with shared prompts run once (below), both fp32, 200 steps,
`--levels 0.1,0.15,0.2`, load average 1.8-3.5: median step 0.39 s (TRL), 0.18 s (Molt sync, 0.47x),
0.15 s (Molt async, 0.39x); generation per step 0.071 s vs 0.060 s (sync, 0.85x) and 0.008 s (async:
what the driver waits; the engine samples while the trainer trains); start-up to the first step done
5.4 s vs 11.1 s (sync) and 12.4 s (async), 2.1-2.3x; wall time from launch to a 10-step mean reward
of 0.1: 38.5 s vs 23.3 s (0.61x) and 22.0 s (0.57x), of 0.15: 43.0 s vs 25.5 s (0.59x) and 23.9 s
(0.56x), of 0.2: 51.1 s vs 29.5 s (0.58x) and 26.6 s (0.52x); final reward 0.25 / 0.24 / 0.24.
Start-up is now most of Molt's time to these levels: launch to Ray up ~6 s (the driver's imports ~3
s, `ray.init` ~2.5 s on a quiet box), then ~5 s until both actors are ready (each imports torch,
transformers and Molt, ~3.7 s; building engine and trainer ~0.25 s), against TRL's one process. The
same with 600 steps (load 2-5, `--levels 0.2,0.3,0.4,0.5`): step 0.43x / 0.35x, time to 0.2 53.3 s
vs 29.4 s (0.55x) and 26.1 s (0.49x); TRL left the ~0.25 plateau after ~400 steps (0.3 at 197 s, 0.5
at 230 s, 0.6 at step 600), neither Molt run did within 600 steps (final 0.23), so the later levels
have no Molt time (one seed each, different sampling streams: luck, or the stop ids or std epsilon
below; an earlier issue measurement had Molt reach 0.5 after ~700 steps). Before (same day, quiet
box, 200 steps): step 0.71x / 0.69x, generation 1.6x TRL's, time to 0.2 1.01x / 0.94x.

Where Molt's step went: a group's 32 samples share one prompt (19 of a row's 23 tokens). The `hf`
engine prefills each distinct prompt once and expands the KV cache to the group's rows; a one-rank
trainer runs the shared context once per group (KV cache expanded, gradients through it; FSDP keeps
the layers unsharded through the step so both forwards share them); the engine sampled by inverse
CDF in these runs (torch.multinomial took ~6 ms per [512, 512] step; it is back to
torch.multinomial, with which the multi-token learning tests learn as before). One thread, in-process: the engine's 512 x
4 tokens 35 ms vs 115 ms for HF `generate` on the same batch; the trainer step 80 ms vs 155 ms for
a bare fwd/bwd/AdamW over full rows (it was 185 ms). Log-probs match a full forward (tests).

`smollm2` with the recipe in bf16 and Molt embedded, measured 2026-12-05 02:26 (`--workload
smollm2 eval.every=5`, load 1.4-1.7; the table and bounds: docs/benchmarks.md): Molt sync / async
vs TRL start-up 11.3 / 10.6 s vs 18.8 s (0.60x / 0.56x), median step 2.43 / 1.97 s vs 12.6 s
(0.19x / 0.16x), wall time to held-out accuracy 0.7 20.8 / 18.5 s vs 133.3 s (0.16x / 0.14x; Molt
at the step-5 evaluation, TRL at step 10), to 0.5 0.31x / 0.28x (all at step 5); the trainer 314 /
224 GFLOP/s on trained tokens vs TRL's 52 (bounds in the same run: fp32 matmul ~205, bf16
842-914 on 2 threads); peak RSS 3.1 / 3.2 GiB vs 5.3 GiB. At 00:27, before the trainer's small
ops were cut: step 0.21x / 0.20x, to 0.7 0.27x / 0.16x, trainer 295 / 190 GFLOP/s.

Before (fp32, Ray actors): `smollm2` on the recipe then (additions and multiplications, operands
2-9, lr 3e-4, 20 steps, `eval.every=10`), measured 2026-12-01 at load ~2: held-out greedy accuracy
TRL 0.125 -> 0.781 -> 0.828, Molt 0.125 -> 0.875 -> 0.875 (steps 0, 10, 20); median step 14.7 s vs
13.7 s (0.93x), generation 36 % of it on both sides; start-up to the first step done 22 s vs 30 s
(1.38x); wall time to held-out accuracy 0.7 (both at the step-10 evaluation) 151 s vs 151 s (1.00x),
to a mean reward of 0.5 181 s vs 177 s (0.98x); final reward 0.78 on both; peak RSS 7.3 GiB vs 8.9
GiB (Molt's process tree; its trainer 6.4 GiB).

`smollm2` (before the recipe moved to additions and multiplications with operands 2-9 and lr 3e-4:
this run used additions and subtractions with operands 2-30, lr 1e-4), measured 2026-12-01 (`--workload smollm2 eval.every=5`: 30 steps, 64 held-out problems;
the shared 2-core box at load average 1.7 before and 2.1 after, up to 4.7 in between from other
sessions' jobs; 23 minutes for both sides): held-out greedy accuracy TRL 0.14 -> 0.17, 0.20, 0.27,
0.47, 0.55, 0.53 after 5, 10, ..., 30 steps; Molt 0.14 -> 0.06, 0.14, 0.28, 0.45, 0.45, 0.52 (64
problems: +-0.06 of noise). Median step 15.4 s (TRL) vs 14.4 s (Molt, 0.93x), generation 38 % vs
36 % of it; start-up to the first step done 28 s vs 32 s; wall time from launch (evaluations
excluded) to held-out accuracy 0.3: 521 s vs 370 s (0.71x; both after 20 steps), to 0.5: 596 s (25
steps) vs 557 s (30 steps) (0.93x); neither reached 0.7; mean reward of the last 10 steps 0.39 vs
0.44; peak RSS 7.3 GiB (TRL's one process) vs 8.9 GiB (Molt's process tree; its largest process,
the trainer, 6.4 GiB). Other jobs' load hit both sides at different times (TRL's steps 3-5 took
34-109 s and 6-10 ~21 s, later ones ~15 s; Molt's steps 12-17 and 21 took 20-54 s): the per-step
medians are the steadier speed ratio; 30 steps summed 11.1 min (TRL) and 9.1 min (Molt).

    python bench/vs_trl.py [--workload addition|addition-system|smollm2] [--steps N] [--schemes sync,async]
                           [--levels 0.3,0.5] [--acc-levels 0.3,0.5,0.7] [--window 10]
                           [--threads N] [key=value ...]
    make bench-trl; make bench-trl-smollm2    (--workload smollm2 needs make pretrained)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    # name: model dir (the recipe's), Molt recipe, the TRL reward, default schemes, Molt overrides
    # the bench always adds
    "addition": {"model": ".cache/tiny-qwen3", "recipe": "recipes/cpu/addition.yaml",
                 "reward": "first_digit", "schemes": "sync,async", "overrides": []},
    # the same task behind a system prompt (139 prompt tokens instead of 20), as agent prompts
    # carry instructions and tool descriptions; a group's 32 rows share all but their 4 answers
    "addition-system": {"model": ".cache/tiny-qwen3", "recipe": "recipes/cpu/addition.yaml",
                        "reward": "first_digit", "schemes": "sync,async", "overrides": [
                            "agent.args.system_prompt=" + json.dumps(
                                "You are a careful arithmetic assistant. The user asks for the "
                                "sum of two small numbers. Reply with the sum as a single digit "
                                "and nothing else, no words, no punctuation, no spaces. Think of "
                                "the two numbers, add them, and answer at once.")]},
    "smollm2": {"model": ".cache/smollm2-135m-instruct",
                "recipe": "recipes/cpu/smollm2_arithmetic.yaml", "reward": "math",
                "schemes": "sync,async", "overrides": ["eval.k=0"]},
}


# --- rewards and measurements shared by both sides (no molt imports) ---------------------------

def first_digit_reward(text: str, answer: str) -> float:
    """molt_gym.Addition's reward: 1 for the sum as the reply's first character, 0.1 for another
    digit."""
    first = text.strip()[:1]
    return 1.0 if first == answer else 0.1 if first.isdigit() else 0.0


def math_reward(text: str, answer: str) -> float:
    """molt_reward_math.math_reward(require_boxed=False): math-verify's parse and verify."""
    from math_verify import parse, verify
    try:
        gold, pred = parse(f"\\boxed{{{answer}}}"), parse(text)
        return float(bool(gold and pred) and verify(gold, pred))
    except Exception:  # as Molt's: a zero reward, never a crash
        return 0.0


REWARDS = {"first_digit": first_digit_reward, "math": math_reward}


class PeakRSS(threading.Thread):
    """Peak RSS of this process's tree, sampled every second: the largest process's and the
    sum's."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.total, self.largest = 0, 0
        self.start()

    def run(self) -> None:
        import psutil
        me = psutil.Process()
        while True:
            rss = []
            for p in [me, *me.children(recursive=True)]:
                try:
                    rss.append(p.memory_info().rss)
                except psutil.Error:
                    pass
            self.total, self.largest = max(self.total, sum(rss)), max(self.largest, *rss)
            time.sleep(1.0)

    def gib(self) -> dict:
        return {"rss_total_gib": self.total / 2**30, "rss_largest_gib": self.largest / 2**30}


def bounds(threads: list[int], reps: int = 8) -> dict:
    """This box's bounds now: the best of `reps` square matmuls per dtype and thread count
    (GFLOP/s), and memory bandwidth (GB/s) as the best of `reps` reads of a 1 GiB tensor."""
    import torch
    before, out = torch.get_num_threads(), {}
    for n in threads:
        torch.set_num_threads(n)
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
            a @ b
            best = min(_timed(lambda: a @ b) for _ in range(reps))
            out[f"matmul {str(dtype)[6:]} {n}t GFLOP/s"] = 2 * 2048**3 / best / 1e9
        x = torch.ones(2**28)       # 1 GiB fp32
        best = min(_timed(x.sum) for _ in range(reps))
        out[f"read {n}t GB/s"] = x.numel() * 4 / best / 1e9
    torch.set_num_threads(before)
    return out


def beside(run: Callable[[], dict]) -> dict:
    """`run()`'s result with `bf16_beside`: per thread count, the mean of the bf16 matmul bound
    taken just before and just after it (the host's speed drifts by 15 % within minutes)."""
    threads = sorted({1, os.cpu_count() or 1})
    before = bounds(threads)
    out = run()
    after = bounds(threads)
    key = "matmul bfloat16 {}t GFLOP/s"
    return {**out, "bf16_beside": {t: (before[key.format(t)] + after[key.format(t)]) / 2
                                   for t in threads}}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def param_count(model_dir: str) -> int:
    """Parameters in the checkpoint (a tied lm_head counted once)."""
    import math

    from safetensors import safe_open
    n = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


# --- TRL side (runs in .venv-trl: no molt imports) ---------------------------------------------

def greedy_accuracy(model, tok, rows: list[dict], new_tokens: int, reward) -> float:
    """Pass@1 of one batched greedy `generate` over the held-out rows."""
    import torch
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
             for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=new_tokens, top_k=None,
                             top_p=None, temperature=None, pad_token_id=tok.pad_token_id)
    model.train(was_training)
    replies = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return statistics.mean(reward(t, r["answer"]) >= 1.0 for t, r in zip(replies, rows))


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    rss = PeakRSS()
    gen_s: list[float] = []
    log_metrics = profiling.ProfilingContext._log_metrics

    def record(self, duration):  # TRL times its generate call; keep it per step
        if self.name.endswith("transformers.generate"):
            gen_s.append(duration)
        return log_metrics(self, duration)
    profiling.ProfilingContext._log_metrics = record

    g, reward_fn = spec["geometry"], REWARDS[spec["reward"]]

    def reward(completions, answer, **_):
        return [reward_fn(c[0]["content"], a) for c, a in zip(completions, answer)]

    steps: list[dict] = []
    evals: list[dict] = []
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    eval_tok = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")

    def held_out(model, step: int) -> None:
        if spec["eval_rows"] and (step % spec["eval_every"] == 0 or step == spec["steps"]):
            t0 = time.time()
            acc = greedy_accuracy(model, eval_tok, spec["eval_rows"], g["new_tokens"], reward_fn)
            evals.append({"step": step, "t0": t0, "t1": time.time(), "acc": acc})

    class Stamp(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            held_out(model, 0)

        def on_log(self, args, state, control, logs=None, model=None, **kw):
            if logs and "reward" in logs:
                steps.append({"t": time.time(), "reward": logs["reward"],
                              "gen_s": gen_s[-1] if gen_s else 0.0,
                              "trained_tokens": logs.get("completions/mean_length", 0.0)
                              * g["prompts"] * g["samples"]})
                held_out(model, state.global_step)

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    peft = None
    if g["lora"]["rank"]:
        from peft import LoraConfig
        lora = g["lora"]
        peft = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                          target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    args = GRPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=g["prompts"] * g["samples"],
        num_generations=g["samples"], max_completion_length=g["new_tokens"],
        temperature=g["temperature"], top_k=0, top_p=1.0, learning_rate=g["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=g["weight_decay"],
        adam_beta1=g["betas"][0], adam_beta2=g["betas"][1], max_grad_norm=g["grad_clip"],
        loss_type="dapo", beta=g["kl_coef"], entropy_coef=g["entropy_coef"],
        scale_rewards="group", max_steps=spec["steps"], logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, shuffle_dataset=False, seed=spec["seed"],
        disable_tqdm=True, log_completions=False, bf16=spec["bf16"], gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list(spec["rows"]), callbacks=[Stamp()],
                          peft_config=peft)
    trainer.train()
    return {"steps": steps, "evals": evals, **rss.gib()}


# --- Molt side ---------------------------------------------------------------------------------

def run_molt(spec: dict) -> dict:
    from molt_core.run.cluster import prestart
    with prestart(spec["recipe"], spec["overrides"]):    # as `molt run`: Ray starts meanwhile
        import molt_core.trainer as trainer
        from molt_core import hookimpl
        from molt_core.cli import load
        cfg, plugins = load(spec["recipe"], spec["overrides"])

    rss = PeakRSS()
    steps: list[dict] = []
    evals: list[dict] = []
    peak: list[float] = []

    class Stamp:
        @hookimpl
        def molt_on_step_end(self, step, metrics):
            steps.append({"t": time.time(), "reward": metrics["reward/mean"],
                          "gen_s": metrics["time/generate_s"],
                          "trained_tokens": metrics["response/len_mean"]
                          * metrics["rollout/trajectories"],
                          **{k: v for k, v in metrics.items() if k.startswith("time/")}})
            peak.append(metrics.get("memory/trainer_peak_gib", 0.0))

    evaluate = trainer.evaluate

    def timed(*a, **kw):   # the held-out pass, stamped like TRL's
        t0 = time.time()
        out = evaluate(*a, **kw)
        evals.append({"step": len(steps), "t0": t0, "t1": time.time(),
                      "acc": out["eval/greedy/pass@1"]})
        return out
    trainer.evaluate = timed
    plugins.pm.register(Stamp())
    trainer.train(cfg, plugins, None, progress=False)
    return {"steps": steps, "evals": evals, "trainer_peak_gib": max(peak), **rss.gib()}


# --- driver (Molt's venv) ----------------------------------------------------------------------

def prompts(plugins, agent_args: dict, tasks: list[int]) -> list[dict]:
    """The gym env's first messages and answers for `tasks`, as Molt's gym agent builds them."""
    import asyncio
    env_cls = plugins.get("env", agent_args["env"])
    system = agent_args.get("system_prompt")
    rows = []
    for task in tasks:
        env = env_cls(**agent_args.get("env_args", {}))
        obs = asyncio.run(env.reset(task))
        answer = env.row["answer"] if hasattr(env, "row") else str(env.a + env.b)
        rows.append({"prompt": ([{"role": "system", "content": system}] if system else [])
                     + [{"role": "user", "content": obs}], "answer": answer})
    return rows


def trl_spec(cfg, plugins, reward: str, threads: int, out_dir: str) -> dict:
    """What the TRL side runs, read from the Molt config both sides share."""
    from molt_core.rollout.eval import EVAL_TASKS
    alg = cfg.algorithm
    if (alg.estimator, alg.loss, alg.loss_agg, alg.correction) != ("grpo", "ppo_clip",
                                                                   "token-mean", "none"):
        raise SystemExit("vs_trl maps grpo + ppo_clip + token-mean (no correction) onto TRL; "
                         f"the recipe has {alg.estimator} + {alg.loss} + {alg.loss_agg}")
    r, t, args = cfg.rollout, cfg.trainer, cfg.agent.args
    g = {"prompts": r.groups_per_step, "samples": r.group_size,
         "new_tokens": cfg.sampling.max_new_tokens, "temperature": cfg.sampling.temperature,
         "lr": t.lr, "weight_decay": t.weight_decay, "betas": t.betas, "grad_clip": t.grad_clip,
         "entropy_coef": alg.terms.entropy_coef, "kl_coef": alg.terms.kl_coef,
         "lora": vars(t.lora)}
    held = {**args, **cfg.eval.agent_args, "env_args": {
        **args.get("env_args", {}), **cfg.eval.agent_args.get("env_args", {})}}
    return {"model": str(ROOT / cfg.model.path), "steps": t.steps, "seed": cfg.seed,
            "bf16": cfg.model.dtype == "bfloat16",
            "threads": threads, "geometry": g, "out_dir": out_dir, "reward": reward,
            "rows": prompts(plugins, args, [cfg.seed * 1_000_003 + i
                                            for i in range(t.steps * r.groups_per_step)]),
            "eval_every": cfg.eval.every, "eval_rows": prompts(plugins, held, [
                EVAL_TASKS + i for i in range(cfg.eval.prompts)]) if cfg.eval.every else []}


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


def summary(run: dict, warmup: int, window: int, levels: list[float], acc_levels: list[float],
            tokens: int, flop_per_token: float, decode_bytes: float) -> dict:
    evals = run["evals"]

    def clock(t: float) -> float:   # seconds since launch, held-out evaluations left out
        return t - run["launch"] - sum(e["t1"] - e["t0"] for e in evals if e["t1"] <= t)

    s = run["steps"]
    ts = [clock(x["t"]) for x in s]
    warmup = min(warmup, len(s) - 2)     # short runs (smoke tests) keep one step
    dts = [b - a for a, b in zip(ts, ts[1:])][warmup:]
    gens = [x["gen_s"] for x in s[warmup + 1:]]
    out = {"s to first step done": ts[0], "step s (median)": statistics.median(dts),
           "generation s (median)": statistics.median(gens),
           "generation share": sum(gens) / sum(dts),
           "tokens/s (sampled, median step)": tokens / statistics.median(dts),
           **phases(s[warmup + 1:], dts, flop_per_token, decode_bytes),
           "final reward": statistics.mean(x["reward"] for x in s[-window:])}
    for lv in levels:
        out[f"s to reward {lv:g}"] = next(
            (ts[i] for i in range(window - 1, len(s))
             if statistics.mean(x["reward"] for x in s[i - window + 1:i + 1]) >= lv), None)
    if evals:
        out["held-out eval s (mean)"] = statistics.mean(e["t1"] - e["t0"] for e in evals)
    for e in evals:
        out[f"greedy acc, step {e['step']}"] = e["acc"]
    for lv in acc_levels if evals else []:
        hit = next((e for e in evals if e["acc"] >= lv), None)
        out[f"s to greedy acc {lv:g}"] = clock(hit["t0"]) if hit else None
        out[f"steps to greedy acc {lv:g}"] = hit["step"] if hit else None
    out["peak RSS GiB (process tree)"] = run["rss_total_gib"]
    out["peak RSS GiB (largest process)"] = run["rss_largest_gib"]
    out["trainer peak GiB (Molt metric)"] = run.get("trainer_peak_gib")
    return out


def phases(s: list[dict], dts: list[float], flop_per_token: float, decode_bytes: float) -> dict:
    """Medians over steps: each phase's seconds, the trainer's GFLOP/s on trained tokens (6 x
    parameters a token), and the engine's weight reads (parameter bytes per decode step) per
    second of generation; Molt times its phases, TRL's train phase is the step less generation."""
    med = statistics.median
    gen = [x.get("time/engine_busy_s", x["gen_s"]) for x in s]    # async: the engine's own time
    train = [x.get("time/train_s", dt - x["gen_s"]) for x, dt in zip(s, dts)]
    out = {"train s (median)": med(train),
           "weight sync s (median)": med(x.get("time/weight_sync_s", 0.0) for x in s),
           "engine busy s (median)": med(gen),
           "trainer GFLOP/s (trained tokens)": med(
               flop_per_token * x["trained_tokens"] / t for x, t in zip(s, train)) / 1e9,
           "engine weight reads GB/s": decode_bytes / med(gen) / 1e9}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=3, metavar=("SIDE", "SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="addition", choices=sorted(WORKLOADS))
    ap.add_argument("--steps", type=int, default=0, help="0: the recipe's trainer.steps")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of per-step medians")
    ap.add_argument("--window", type=int, default=10, help="steps in the reward mean")
    ap.add_argument("--levels", default="0.3,0.5", help="mean reward levels")
    ap.add_argument("--acc-levels", default="0.3,0.5,0.7", help="held-out greedy accuracy levels")
    ap.add_argument("--schemes", default="", help="Molt rollout schemes; default: the workload's")
    ap.add_argument("--seed", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads of TRL's process "
                    "and of each Molt actor (Molt: ray.num_cpus); 0: each side's default")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"))
    ap.add_argument("--json", default="", help="write the raw runs and the table here too")
    ap.add_argument("overrides", nargs="*", help="key=value for the recipe (both sides)")
    args = ap.parse_args()
    if args.worker:
        side, spec_path, out_path = args.worker
        spec = json.loads(Path(spec_path).read_text())
        out = run_trl(spec) if side == "trl" else run_molt(spec)
        Path(out_path).write_text(json.dumps(out))
        return

    import tempfile

    from molt_core.cli import load
    w = WORKLOADS[args.workload]
    common = [*w["overrides"], "check.consistency_every=0",
              *([f"trainer.steps={args.steps}"] if args.steps else []),
              *([f"seed={args.seed}"] if args.seed is not None else []),
              *([f"ray.num_cpus={args.threads}"] if args.threads else []), *args.overrides]
    if not (ROOT / w["model"] / "config.json").exists():
        if not args.workload.startswith("addition"):
            raise SystemExit(f"{w['model']} is missing: make pretrained")
        from molt_tools.tiny import build_tiny_model
        build_tiny_model(ROOT / w["model"])
    cfg, plugins = load(w["recipe"], common)
    levels = [float(x) for x in args.levels.split(",")]
    acc_levels = [float(x) for x in args.acc_levels.split(",")]
    scheme_args = {"sync": ["rollout.scheme=sync"],
                   "async": ["rollout.scheme=async", "rollout.max_staleness=1",
                             "algorithm.correction=tis"]}
    r = cfg.rollout
    tokens = r.groups_per_step * r.group_size * cfg.sampling.max_new_tokens
    results = {}
    box = bounds(sorted({1, os.cpu_count() or 1}))
    with tempfile.TemporaryDirectory() as tmp:
        spec = trl_spec(cfg, plugins, w["reward"], args.threads, tmp + "/trl")
        results["trl"] = beside(lambda: launch(args.trl_python, "trl", spec, Path(tmp)))
        for scheme in (args.schemes or w["schemes"]).split(","):
            spec = {"recipe": w["recipe"], "overrides": common + scheme_args[scheme]}
            results[f"molt {scheme}"] = beside(
                lambda: launch(sys.executable, "molt", spec, Path(tmp)))
    n = param_count(str(ROOT / w["model"]))
    decode_bytes = n * (2 if cfg.model.dtype == "bfloat16" else 4) * cfg.sampling.max_new_tokens
    rows = {k: summary(v, args.warmup, args.window, levels, acc_levels, tokens, 6.0 * n,
                       decode_bytes) for k, v in results.items()}
    for k, v in results.items():    # the trainer against the bf16 bound taken beside its run
        for t, b in v["bf16_beside"].items():
            rows[k][f"trainer / bf16 {t}t bound beside"] = (
                rows[k]["trainer GFLOP/s (trained tokens)"] / b)
    load_avg = os.getloadavg()
    print(f"\n{args.workload}: {r.groups_per_step}x{r.group_size} samples, "
          f"{cfg.sampling.max_new_tokens} new tokens, lr {cfg.trainer.lr:g}, lora rank "
          f"{cfg.trainer.lora.rank}, {cfg.trainer.steps} steps; load average "
          f"{load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f}")
    box.update({f"{k} (after)": v for k, v in bounds(sorted({1, os.cpu_count() or 1})).items()})
    print("bounds: " + ", ".join(f"{k} {v:.0f}" for k, v in box.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "rows": rows, "bounds": box,
                                               "load": load_avg}, indent=1))
    names = list(rows)
    print(f"{'':34}" + "".join(f"{n:>14}" for n in names)
          + "".join(f"{n + '/trl':>18}" for n in names[1:]))
    for key in rows["trl"]:
        vals = [rows[n].get(key) for n in names]
        cells = "".join(f"{'-' if v is None else f'{v:.3f}':>14}" for v in vals)
        ratios = "".join(f"{'-' if not (v and vals[0]) else f'{v / vals[0]:.2f}':>18}"
                         for v in vals[1:])
        print(f"{key:34}{cells}{ratios}")


if __name__ == "__main__":
    main()
