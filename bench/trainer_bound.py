"""The trainer against this box's matmul bound on the real model (issue 29): Molt's train step on
SmolLM2-135M-Instruct with the smollm2 workload's rows (4 recipe prompts x 8 samples of 16 new
tokens, sampled once with HF `generate`), timed interleaved with, in the same process,
  bare   a plain PyTorch forward/backward/AdamW on the same rows (HF model, PEFT LoRA or full, the
         same compute dtype; lm_head only at trainable positions; no Molt), and
  matmul a plain square matmul at the trainer's threads, fp32 and bf16 (the bound), and the
         model's own matmuls at their shapes in the compute dtype: for every Linear weight the
         three GEMMs 6 x N counts, on the trained tokens' rows (`shapes`, the tighter bound).

    python bench/trainer_bound.py [--full] [--rounds 5] [--threads 2] [--clock wall|cpu]
                                  [key=value ...]   (recipe overrides, e.g. model.dtype=bfloat16)

Prints achieved GFLOP/s on trained tokens (6 x params x trained tokens / step time, the issue's
measure; LoRA's backward skips the frozen weights' gradients, so it does less work than that),
the ratio to the matmul bound measured beside it, and where Molt's step goes (forward trunk,
log-prob head, loss, backward, optimizer, the rest) from one instrumented step. Other jobs share
this box: every number is the median (and best) of interleaved rounds, with the load beside it;
`--clock cpu` times everything (the bound included) in process CPU time, steady with one thread
on a loaded box (with two, OpenMP's spinning threads count too).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from molt_core import lora as molt_lora
from molt_core.advantage import training_batch
from molt_core.cli import load
from molt_core.multimodal import load_tokenizer
from molt_core.policy import logprobs as lp_mod
from molt_core.policy import worker as worker_mod
from molt_core.policy.handle import Policy
from molt_core.policy.objective import objective
from molt_core.trainer import train_step
from molt_core.trajectory import Trajectory

RECIPE = "recipes/cpu/smollm2_arithmetic.yaml"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
now = time.perf_counter                  # --clock cpu: time.process_time


def rows(cfg: Any, plugins: Any, tok: Any, seed: int = 0) -> list[Trajectory]:
    """The workload's trajectories: the recipe's first prompts (as the gym agent renders them),
    `group_size` samples each at the recipe's temperature (fp32 HF generate, processed log-probs),
    cut after EOS; rewards 0/1 at random (GRPO needs a spread, the compute does not)."""
    from transformers import AutoModelForCausalLM
    args, r = cfg.agent.args, cfg.rollout
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    env_cls, g = plugins.get("env", args["env"]), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    out = []
    for group in range(r.groups_per_step):
        env = env_cls(**args.get("env_args", {}))
        obs = asyncio.run(env.reset(cfg.seed * 1_000_003 + group))
        msgs = [{"role": "system", "content": args["system_prompt"]},
                {"role": "user", "content": obs}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        ids = torch.tensor([prompt] * r.group_size)
        with torch.no_grad():
            gen = model.generate(ids, do_sample=True, temperature=cfg.sampling.temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=cfg.sampling.max_new_tokens,
                                 output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id or 0)
        new = gen.sequences[:, len(prompt):]
        logp = torch.stack(gen.scores, 1).float().log_softmax(-1).gather(
            -1, new[..., None]).squeeze(-1)
        for i in range(r.group_size):
            resp = new[i].tolist()
            if tok.eos_token_id in resp:
                resp = resp[:resp.index(tok.eos_token_id) + 1]
            t = Trajectory(group_id=group, rollout_id=len(out),
                           reward=float(torch.rand((), generator=g) < 0.5))
            t.add_prompt(prompt)
            n = len(resp)
            t.token_ids += resp
            t.loss_mask += [True] * n
            t.logprobs += logp[i, :n].tolist()
            t.versions += [0] * n
            out.append(t)
    return out


def bare_step_fn(cfg: Any, batch: dict[str, torch.Tensor], dtype: torch.dtype,
                 threads: int) -> Any:
    """A plain HF model (PEFT LoRA as the recipe's, or full) and AdamW: forward over the padded
    rows, lm_head + log_softmax at trainable positions, PPO-clip token-mean, backward, clip,
    step."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    t = cfg.trainer
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    if t.lora.rank:
        model = get_peft_model(model, molt_lora.peft_config(
            vars(t.lora) | {"target_modules": molt_lora._targets(model, t.lora.target_modules)}))
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    ids, att, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    T = int(att.sum(-1).max())
    ids, att, mask = ids[:, :T], att[:, :T], mask[:, :T]
    beh, adv = batch["behavior_logprobs"][:, :T], batch["advantages"][:, :T]
    rows_, cols = mask[:, 1:].nonzero(as_tuple=True)
    targets, old, a = ids[rows_, cols + 1], beh[rows_, cols + 1], adv[rows_, cols + 1]
    base = model.get_base_model() if t.lora.rank else model

    def step() -> None:
        torch.set_num_threads(threads)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            h = base.model(input_ids=ids, attention_mask=att).last_hidden_state[rows_, cols]
            logp = base.lm_head(h).float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        ratio = (logp - old).exp()
        loss = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def matmul_gflops(dtype: torch.dtype, threads: int, n: int = 2048, seconds: float = 1.0) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    done, t0 = 0, now()
    while now() - t0 < seconds:
        a @ b
        done += 1
    return 2 * n**3 * done / (now() - t0) / 1e9


def shape_gflops(model: torch.nn.Module, tokens: int, dtype: torch.dtype, threads: int,
                 reps: int = 3) -> float:
    """The matmul bound at the model's own shapes: for every Linear weight W [out, in] (lm_head
    included), the three GEMMs that 6 x N counts for `tokens` rows (X W^T, G W, G^T X) as plain
    matmuls in `dtype`; 6 x N x tokens over their best time."""
    torch.set_num_threads(threads)
    shapes: dict[tuple[int, int], int] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ".lora_" not in name:   # adapters: not in N
            shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    best, flop = float("inf"), 0.0
    for _ in range(reps):
        total, flop = 0.0, 0.0
        for (out, inp), count in shapes.items():
            w, x = torch.randn(out, inp, dtype=dtype), torch.randn(tokens, inp, dtype=dtype)
            g = torch.randn(tokens, out, dtype=dtype)
            for fn in (lambda: x @ w.T, lambda: g @ w, lambda: g.T @ x):
                fn()
                t0 = now()
                fn()
                total += (now() - t0) * count
            flop += 6.0 * out * inp * tokens * count
        best = min(best, total)
    return flop / best / 1e9


@contextmanager
def _timing(times: dict[str, float], obj: Any, name: str, key: str = "") -> Iterator[None]:
    """Time every call of `obj.name` into times[key or name] (this bench's breakdown only)."""
    fn, own, key = getattr(obj, name), name in vars(obj), key or name

    def timed(*a: Any, **k: Any) -> Any:
        t0 = now()
        try:
            return fn(*a, **k)
        finally:
            times[key] = times.get(key, 0.0) + now() - t0
    setattr(obj, name, timed)
    try:
        yield
    finally:
        setattr(obj, name, fn) if own else delattr(obj, name)


def breakdown(policy: Policy, batch: dict[str, torch.Tensor], spec: Any) -> dict[str, float]:
    """One train step of the in-driver rank, cut where Molt's pieces meet (seconds)."""
    w = policy.workers[0].worker
    times: dict[str, float] = {}
    t0 = now()
    head = ((lp_mod._Head, "apply") if hasattr(lp_mod, "_Head")     # before: _chunked
            else (lp_mod, "_chunked"))
    trunk = "_trunk" if hasattr(lp_mod, "_trunk") else "_shared_context"    # before: a cache
    with (_timing(times, *head, "head"), _timing(times, lp_mod, trunk, "trunk"),
          _timing(times, worker_mod, "objective"), _timing(times, w, "_forward"),
          _timing(times, w, "_optimizer_step"), _timing(times, torch.Tensor, "backward")):
        policy.train(batch, spec)
    total = now() - t0
    fwd = times.get("_forward", 0.0)
    out = {"trunk forward (prompts and rows)": times.get("trunk", 0.0),
           "rest of forward": fwd - times.get("head", 0.0) - times.get("trunk", 0.0),
           "log-prob head (fwd)": times.get("head", 0.0),
           "loss": times.get("objective", 0.0), "backward": times.get("backward", 0.0),
           "optimizer": times.get("_optimizer_step", 0.0)}
    out["molt overhead (rest)"] = total - sum(out.values())
    return {"total_s": round(total, 3), **{k: round(v / total, 3) for k, v in out.items()}}


def main() -> None:
    global now
    argv = sys.argv[1:]
    if "--clock" in argv:
        i = argv.index("--clock")
        now = time.process_time if argv.pop(i + 1) == "cpu" else time.perf_counter
        argv.pop(i)
    full = "--full" in argv
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 5
    threads = int(argv[argv.index("--threads") + 1]) if "--threads" in argv else 2
    skip = {"--full"} | {argv[i + 1] for i, a in enumerate(argv) if a in ("--rounds", "--threads")}
    overrides = [a for a in argv if a not in skip and a not in ("--rounds", "--threads")]
    if full:
        overrides = ["trainer.lora.rank=0", "trainer.lr=2e-5", *overrides]
    cfg, plugins = load(RECIPE, overrides)
    torch.set_num_threads(threads)
    tok = load_tokenizer(cfg.model.path)
    trajs = rows(cfg, plugins, tok)
    batch, _, _ = training_batch(trajs, plugins.get("estimator", cfg.algorithm.estimator),
                                 cfg.algorithm, None, cfg.sampling.temperature,
                                 tok.pad_token_id or 0)
    spec = train_step(cfg, plugins, 0, 0)
    trained = int(batch["loss_mask"].sum())
    dtype = DTYPES[cfg.model.dtype]
    policy = Policy(cfg.model.path, cfg.trainer, dtype=cfg.model.dtype, seed=cfg.seed,
                    num_threads=threads)
    n_params = sum(p.numel() for p in
                   policy.workers[0].worker.model.parameters()) - trainable_lora(policy)
    flop = 6 * n_params * trained
    bare = bare_step_fn(cfg, batch, dtype, threads)

    def molt() -> None:
        torch.set_num_threads(threads)
        policy.train(batch, spec)
    runs: dict[str, list[float]] = {"molt": [], "bare": [], "mm_fp32": [], "mm_bf16": [],
                                    "mm_shapes": []}
    model = policy.workers[0].worker.model
    molt(), bare()                       # warm-up: allocations, oneDNN kernels
    load0 = os.getloadavg()
    for _ in range(rounds):
        for name, fn in (("molt", molt), ("bare", bare)):
            t0 = now()
            fn()
            runs[name].append(now() - t0)
        runs["mm_fp32"].append(matmul_gflops(torch.float32, threads))
        runs["mm_bf16"].append(matmul_gflops(torch.bfloat16, threads))
        runs["mm_shapes"].append(shape_gflops(model, trained, dtype, threads))
    parts = breakdown(policy, batch, spec)
    policy.shutdown()
    med = {k: statistics.median(v) for k, v in runs.items()}
    best = {k: (min(v) if k in ("molt", "bare") else max(v)) for k, v in runs.items()}
    gf = {k: flop / med[k] / 1e9 for k in ("molt", "bare")}
    lens = batch["attention_mask"].sum(-1).float()
    print(json.dumps({
        "mode": "full" if full else f"lora r={cfg.trainer.lora.rank}", "dtype": cfg.model.dtype,
        "threads": threads, "clock": now.__name__,
        "rows": f"{cfg.rollout.groups_per_step}x{cfg.rollout.group_size}",
        "row_tokens_mean_max": [round(float(lens.mean()), 1), int(lens.max())],
        "trained_tokens": trained, "params": n_params, "gflop_per_step": round(flop / 1e9, 1),
        "step_s_median_best": {k: [round(med[k], 3), round(best[k], 3)] for k in ("molt", "bare")},
        "gflops_on_trained_tokens": {k: round(v, 1) for k, v in gf.items()},
        "matmul_bound_gflops_median_best": {k[3:]: [round(med[k], 1), round(best[k], 1)]
                                            for k in ("mm_fp32", "mm_bf16", "mm_shapes")},
        "molt_over_shape_bound": round(gf["molt"] / med["mm_shapes"], 3),
        "molt_over_fp32_bound": round(gf["molt"] / med["mm_fp32"], 3),
        "molt_over_bf16_bound": round(gf["molt"] / med["mm_bf16"], 3),
        "bare_over_fp32_bound": round(gf["bare"] / med["mm_fp32"], 3),
        "molt_step_over_bare": round(med["molt"] / med["bare"], 3),
        "molt_breakdown": parts, "rounds": rounds,
        "load_1_5_15_start_end": [list(map(lambda x: round(x, 1), load0)),
                                  [round(x, 1) for x in os.getloadavg()]],
    }))


def trainable_lora(policy: Policy) -> int:
    """Adapter parameters: not part of the model's 6 x N (the issue counts the base's)."""
    return sum(p.numel() for n, p in policy.workers[0].worker.model.named_parameters()
               if ".lora_" in n)


if __name__ == "__main__":
    main()
