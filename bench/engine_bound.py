"""The hf engine's decode against a bare batched decode of the same requests and against this
box's bounds (issue 29): SmolLM2-135M-Instruct, the smollm2 recipe's real prompts.

    python bench/engine_bound.py [--threads N] [--dtypes float32,bfloat16] [--reps R]
                                 [--clock wall|cpu] [--before REV] [--workload NAME]
                                 [--recipe PATH] [key=value ...]

In one process, interleaved (the box is shared: absolute times are noisy, compare ratios), for
each workload (the recipe's groups x group_size rows sharing a prompt per group, and batch 32
distinct prompts) and each dtype:
  engine  `HFEngine.generate_batch` of the requests (stop ids off, so every row makes exactly
          max_new_tokens tokens and both loops do the same work);
  bare    a plain HF model's forward (its own copy: sdpa, aten GEMMs) with a DynamicCache over
          the same left-padded rows (each distinct prompt prefilled once, as the engine does),
          softmax + torch.multinomial, nothing else;
  engine@REV  (`--before REV`) the engine as of git revision REV, for a before/after;
  bound   prefill FLOPs / matmul rate + per decode step max(weight bytes / bandwidth, step FLOPs
          / matmul rate), with bandwidth from a sum over a tensor the size of the weights and the
          rate from a 1024^3 matmul in the same dtype, both on the same threads: the faster of
          aten's (MKL's sgemm in fp32: ~110 GFLOP/s a thread on this AMD CPU) and oneDNN's on a
          packed weight (~260 in fp32), as the engine runs its Linear layers.
`--clock cpu` times everything (bounds included) in process CPU time, steadier with one thread
on a loaded box (with more, idle OpenMP threads spin and count). Prints best and median seconds,
tokens/s, ms per decode step, engine/bare and engine/bound ratios, and where the time goes
(prefill, forward steps, sampling + log-probs, the rest: Python and bookkeeping), and the gap
between the engine's behavior log-probs and a full-sequence forward's (the trainer's recompute)
in each dtype. Numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import types
from collections import defaultdict
from dataclasses import asdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from molt_core.cli import load
from molt_core.engines.hf import HFEngine


def _arg(args: list[str], flag: str, default: str) -> str:
    if flag in args:
        i = args.index(flag)
        value = args[i + 1]
        del args[i:i + 2]
        return value
    return default


def prompts(cfg, plugins, tasks: list[int]) -> list[list[int]]:
    """The recipe agent's first prompts (system prompt + the env's problem, chat template)."""
    args = cfg.agent.args
    env_cls = plugins.get("env", args["env"])
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    system = [{"role": "system", "content": args["system_prompt"]}] \
        if args.get("system_prompt") else []
    out = []
    for task in tasks:
        obs = asyncio.run(env_cls(**args.get("env_args", {})).reset(task))
        text = tok.apply_chat_template(system + [{"role": "user", "content": obs}],
                                       tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


now = time.perf_counter     # --clock cpu: time.process_time (one thread on a loaded box)


class Clock:
    """Seconds per named part on `now`."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            t = now()
            out = fn(*a, **k)
            self.s[name] += now() - t
            return out
        return timed


def engine_at(rev: str) -> type:
    """HFEngine as of git revision `rev`, for a before/after in one process."""
    src = subprocess.run(["git", "show", f"{rev}:molt_core/engines/hf.py"], check=True,
                         capture_output=True, text=True).stdout
    module = types.ModuleType(name := f"hf_at_{rev.replace('~', '_')}")
    sys.modules[name] = module             # dataclasses look their module up
    exec(compile(src, f"hf.py@{rev}", "exec"), module.__dict__)
    return module.HFEngine


def run_engine(engine: HFEngine, rows: list[list[int]], sampling: dict,
               completions: list | None = None) -> tuple[Clock, int]:
    clock = Clock()
    for name in ("_prefill", "_step", "_sample"):
        setattr(engine, name, clock.wrap(name, getattr(type(engine), name).__get__(engine)))
    steps0 = engine._stats["decode_steps"]
    out = clock.wrap("total", lambda: asyncio.run(
        engine.generate_batch(rows, [sampling] * len(rows))))()
    for name in ("_prefill", "_step", "_sample"):
        delattr(engine, name)
    bad = [c for c in out if isinstance(c, Exception)]
    if bad:
        raise bad[0]
    assert all(len(c.token_ids) == sampling["max_new_tokens"] for c in out)
    if completions is not None:
        completions[:] = out
    return clock, engine._stats["decode_steps"] - steps0


@torch.no_grad()
def run_bare(model, rows: list[list[int]], new_tokens: int, gen: torch.Generator,
             pad: int) -> tuple[Clock, int]:
    """HF forward + DynamicCache + multinomial, the minimal batched decode of `rows`."""
    clock = Clock()
    t0 = now()
    first: dict = {}
    inv = torch.tensor([first.setdefault(tuple(r), len(first)) for r in rows])
    L = max(len(p) for p in first)
    ids = torch.full((len(first), L), pad)
    mask = torch.zeros(len(first), L, dtype=torch.long)
    for i, p in enumerate(first):
        ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p), 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    forward = clock.wrap("forward", model)
    cache = DynamicCache(config=model.config)
    logits = clock.wrap("prefill", model)(input_ids=ids, attention_mask=mask, position_ids=pos,
                                          past_key_values=cache, use_cache=True,
                                          logits_to_keep=1).logits[inv, -1]
    cache.batch_select_indices(inv)
    mask, pos = mask[inv], pos[inv, -1:]
    sample = clock.wrap("sample", lambda x: torch.multinomial(x.float().softmax(-1), 1,
                                                              generator=gen))
    for step in range(new_tokens):
        token = sample(logits)
        if step == new_tokens - 1:
            break
        mask, pos = torch.cat([mask, mask.new_ones(len(rows), 1)], 1), pos + 1
        logits = forward(input_ids=token, attention_mask=mask, position_ids=pos,
                         past_key_values=cache, use_cache=True).logits[:, -1]
    clock.s["total"] = now() - t0
    return clock, new_tokens - 1


@torch.no_grad()
def logprob_gap(model, rows: list[list[int]], completions: list) -> dict:
    """|engine behavior log-prob - a full-sequence forward's (what the trainer recomputes)| over
    the sampled tokens of 8 rows, temperature 1 (the recipe's)."""
    gaps = []
    for prompt, c in list(zip(rows, completions))[::max(1, len(rows) // 8)]:
        ids = torch.tensor([prompt + c.token_ids])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        lp = logits.log_softmax(-1).gather(1, ids[0, len(prompt):, None]).squeeze(1)
        gaps.append((lp - torch.tensor(c.logprobs)).abs())
    gaps = torch.cat(gaps)
    return {"max": gaps.max().item(), "mean": gaps.mean().item()}


def best_of(fn, seconds: float = 1.0, tries: int = 8) -> float:
    times, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(times) < tries:
        t = now()
        fn()
        times.append(now() - t)
    return min(times)


def bounds(model, dtype: torch.dtype, rows: list[list[int]], new_tokens: int) -> dict:
    """The decode's bound on this box's measured bandwidth and matmul rate, on the current
    threads. FLOPs: 2 x (Linear weights, lm_head included) per token + attention's QK and PV."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    attn = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim     # x context, per token
    x = torch.ones(weights // 4)
    bandwidth = weights / best_of(x.sum)
    del x
    a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(b)
    rates = {"aten": 2 * 1024 ** 3 / best_of(lambda: a @ b),     # MKL's sgemm in fp32
             "onednn packed": 2 * 1024 ** 3 / best_of(
                 lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))}
    rate = max(rates.values())
    distinct = {tuple(r) for r in rows}
    prefill = sum(2 * linear * len(p) + attn * len(p) ** 2 / 2 for p in distinct)
    L = max(len(r) for r in rows)
    steps = [len(rows) * (2 * linear + attn * (L + s)) for s in range(1, new_tokens)]
    step_s = [max(weights / bandwidth, f / rate) for f in steps]
    # what an eager forward cannot beat: one step's matmuls at their shapes, weights from memory
    xs = {m.in_features: torch.randn(len(rows), m.in_features, dtype=dtype)
          for m in model.modules() if isinstance(m, torch.nn.Linear)}
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packs = [torch.ops.mkldnn._reorder_linear_weight(w) for w in linears]
    matmuls = {"aten": best_of(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w)
                                        for w in linears]),
               "onednn packed": best_of(lambda: [torch.ops.mkldnn._linear_pointwise(
                   xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(linears, packs)])}
    return {"weights_gb": weights / 1e9, "bandwidth_gbs": bandwidth / 1e9,
            "matmul_gflops": {k: v / 1e9 for k, v in rates.items()}, "prefill_s": prefill / rate,
            "step_ms": 1e3 * statistics.mean(step_s), "total_s": prefill / rate + sum(step_s),
            "step_matmuls_ms": {k: 1e3 * v for k, v in matmuls.items()},
            "step_bound_by": "flops" if steps[0] / rate > weights / bandwidth else "bandwidth"}


def summary(runs: list[tuple[Clock, int]], tokens: int) -> dict:
    times = [c.s["total"] for c, _ in runs]
    best = min(runs, key=lambda r: r[0].s["total"])[0]
    steps = runs[0][1]
    parts = {k: v for k, v in best.s.items() if k != "total"}
    fwd = parts.get("_step", parts.get("forward", 0.0))
    return {"best_s": min(times), "median_s": statistics.median(times),
            "tokens_per_s": tokens / min(times), "decode_steps": steps,
            "step_ms": 1e3 * fwd / max(steps, 1),
            "breakdown_s": {"prefill": parts.get("_prefill", parts.get("prefill", 0.0)),
                            "forward steps": fwd,
                            "sampling+logprobs": parts.get("_sample", parts.get("sample", 0.0)),
                            "python+bookkeeping": best.s["total"] - sum(parts.values())}}


def main() -> None:
    global now
    args = sys.argv[1:]
    if _arg(args, "--clock", "wall") == "cpu":
        now = time.process_time
    threads = int(_arg(args, "--threads", "2"))
    dtypes = _arg(args, "--dtypes", "float32").split(",")
    reps = int(_arg(args, "--reps", "5"))
    recipe = _arg(args, "--recipe", "recipes/cpu/smollm2_arithmetic.yaml")
    rev = _arg(args, "--before", "")
    only = _arg(args, "--workload", "")                 # one of the two (default both)
    cfg, plugins = load(recipe, args)
    r, s = cfg.rollout, cfg.sampling
    groups = [p for p in prompts(cfg, plugins, list(range(r.groups_per_step)))
              for _ in range(r.group_size)]
    workloads = {f"{r.groups_per_step}x{r.group_size}": groups,
                 "32 distinct": prompts(cfg, plugins, list(range(100, 132)))}
    if only:
        workloads = {k: v for k, v in workloads.items() if k == only}
    sampling = {**asdict(s), "stop_token_ids": []}      # every row makes max_new_tokens tokens
    n = s.max_new_tokens
    print(f"clock {now.__name__}, threads {threads}, dtypes {dtypes}, reps {reps}, {n} new "
          f"tokens; prompt tokens {sorted({len(p) for p in groups})}; load {os.getloadavg()}",
          flush=True)
    engines = {d: HFEngine(cfg.model.path, dtype=d, num_threads=threads, seed=cfg.seed)
               for d in dtypes}
    plain = {d: AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, d))
             for d in dtypes}
    before = {d: engine_at(rev)(cfg.model.path, dtype=d, num_threads=threads, seed=cfg.seed)
              for d in dtypes} if rev else {}
    gen = torch.Generator().manual_seed(cfg.seed)
    results = {}
    for name, rows in workloads.items():
        for d, engine in engines.items():
            runners = {"engine": lambda: run_engine(engine, rows, sampling),
                       "bare": lambda: run_bare(plain[d], rows, n, gen, engine.pad_id)}
            if rev:
                runners[f"engine@{rev}"] = lambda: run_engine(before[d], rows, sampling)
            runs: dict[str, list] = {k: [] for k in runners}
            for rep in range(reps + 1):                     # interleaved; rep 0 is a warm-up
                for k, fn in runners.items():
                    result = fn()
                    if rep:
                        runs[k].append(result)
            out = {k: summary(v, len(rows) * n) for k, v in runs.items()}
            completions: list = []
            run_engine(engine, rows, sampling, completions)
            out["logprob_gap"] = {f"vs {t} forward": logprob_gap(e.model, rows, completions)
                                  for t, e in engines.items()}
            out["bound"] = bounds(engine.model, getattr(torch, d), rows, n)
            e, b, bd = out["engine"], out["bare"], out["bound"]
            out["ratios"] = {
                "engine/bare best": e["best_s"] / b["best_s"],
                "engine/bare median": e["median_s"] / b["median_s"],
                "engine/bound best": e["best_s"] / bd["total_s"],
                "engine step/bound step": e["step_ms"] / bd["step_ms"]} | ({
                f"engine/engine@{rev} best": e["best_s"] / out[f"engine@{rev}"]["best_s"],
                f"engine/engine@{rev} median": e["median_s"] / out[f"engine@{rev}"]["median_s"]}
                if rev else {})
            results[f"{name} {d}"] = out
            print(f"\n== {name} rows, {d}, load {os.getloadavg()[0]:.2f}")
            for k in runs:
                x = out[k]
                print(f"  {k:<7} best {x['best_s']:.3f} s  median {x['median_s']:.3f} s  "
                      f"{x['tokens_per_s']:.0f} tok/s  "
                      f"{x['decode_steps']} steps x {x['step_ms']:.1f} ms forward")
                print("          " + "  ".join(f"{p} {v:.3f}" for p, v in
                                                x["breakdown_s"].items()))
            print(f"  bound   {bd['total_s']:.3f} s (prefill {bd['prefill_s']:.3f} s, step "
                  f"{bd['step_ms']:.1f} ms by {bd['step_bound_by']}; {bd['weights_gb']:.3f} GB "
                  f"at {bd['bandwidth_gbs']:.1f} GB/s; GFLOP/s " + ", ".join(
                      f"{k} {v:.0f}" for k, v in bd["matmul_gflops"].items()) + "); a "
                  "step's matmuls at their shapes, ms: " + ", ".join(
                      f"{k} {v:.1f}" for k, v in bd["step_matmuls_ms"].items()))
            print("  " + "  ".join(f"{k} {v:.2f}" for k, v in out["ratios"].items()))
            print("  engine log-prob gap " + "  ".join(
                f"{k}: max {v['max']:.2g} mean {v['mean']:.2g}"
                for k, v in out["logprob_gap"].items()), flush=True)
    print("\n" + json.dumps({"clock": now.__name__, "threads": threads,
                             "load_end": os.getloadavg(), **results}, default=float))


if __name__ == "__main__":
    main()
