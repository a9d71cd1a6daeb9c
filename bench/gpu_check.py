"""First GPU check (issue 30): engine and trainer in ONE process on random-init Qwen3 shapes.

Per shape (CUDA: Qwen3-0.6B and -1.7B dense shapes and a small Qwen3-MoE; `--dry-run`: tiny
shapes on the CPU) and phase (bf16 full fine-tuning, bf16 LoRA, fp32 full fine-tuning), a few
sync steps of the trainer loop's own parts: `Generator` over the `hf` engine built in this process,
GRPO advantages (`training_batch`), `Policy.train` of `train_step(...)` on one in-process `fsdp2`
rank (fp32 master weights, forward/backward in the phase's dtype), then a weight push straight
into the engine's parameters and `probe_consistency` on fresh on-policy tokens. It prints a table
(generated and trained tokens/s, trainer MFU against a matmul measured in the same run, weight
sync time, peak memory, the engine-vs-trainer log-prob gap) and writes everything to
`OUT/gpu_check.json` (OUT: `--out`, else `$OUT`).

    python bench/gpu_check.py [--dry-run] [--out DIR] [--shapes a,b] [--budget-s S]

Exit status 3: some shape or phase failed (everything else still ran and is in the JSON).

Each shape runs in its own child process (a CUDA fault cannot spoil the next shape) with what is
left of the time budget; a failed phase is recorded (`error`, with its traceback) and the next
one runs. Every child rewrites its shape's JSON after each phase, so a timeout keeps what ran.

The GPU machine has no Ray, no vLLM, no Molt install and no network: this script puts the repo
and the plugin sources it uses on `sys.path`, imports the core modules with `ray` bound to a
stand-in that raises on any use (they import Ray at the top, the embedded path calls none of it;
the real package is never loaded: `ray_loaded` in the JSON), and appends the wheels in
`.cache/gpu-wheels/` to `sys.path`, so they serve only what the machine lacks. Carry that
folder: it holds structlog (`cp /opt/pypi/files/structlog-*.whl .cache/gpu-wheels/` or `pip
download structlog`); nothing here imports math-verify. Versions there: torch 2.11,
transformers 5.17.

Runs: none on a GPU yet. 2026-12-02, CPU dry run only (2-core box, torch 2.13): every phase of
both tiny shapes ran (fp32 gap 4.8e-07, bf16 1-4e-03) but tiny-moe bf16-lora, which fails (PEFT's
all-linear adapts the MoE router and expert weights: the trainer finds no gates); the same with
transformers 5.17.0 + huggingface-hub 1.33.0 on the path. A 151936-token vocabulary on the tiny
layers ran too (fp32 gap 9.5e-07; its bf16 train steps ~6x slower than fp32 on this CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PLUGINS = ["plugins/estimators/grpo"]           # sources of what the check imports
WHEELS = REPO / ".cache" / "gpu-wheels"

# Qwen3-0.6B / -1.7B text shapes, a small Qwen3-MoE (30B-A3B's layout, fewer and smaller experts)
QWEN = dict(vocab_size=151936, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=40960, rms_norm_eps=1e-6)
SHAPES = {
    "qwen3-0.6b": dict(QWEN, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(QWEN, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       tie_word_embeddings=True),
    "qwen3-moe-1b": dict(QWEN, num_key_value_heads=4, hidden_size=1024, intermediate_size=3072,
                         num_hidden_layers=12, tie_word_embeddings=False, num_experts=32,
                         num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True),
}
TINY = dict(vocab_size=1024, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            max_position_embeddings=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, tie_word_embeddings=True)
DRY_SHAPES = {"tiny-dense": TINY,
              "tiny-moe": dict(TINY, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, norm_topk_prob=True)}
# phase -> (model.dtype, LoRA rank, steps on CUDA, steps in the dry run)
PHASES = {"bf16-full": ("bfloat16", 0, 3, 2), "bf16-lora": ("bfloat16", 16, 3, 2),
          "fp32-full": ("float32", 0, 2, 1)}
# rollout geometry: groups x group size, prompt and new tokens, trainer micro-batch, lm_head chunk
GEOMETRY = {"cuda": dict(groups=8, group_size=8, prompt=128, new=128, micro=32, chunk=1024),
            "cpu": dict(groups=2, group_size=4, prompt=16, new=8, micro=8, chunk=16)}
PHASE_FIELDS = ("gen_tok_s", "train_tok_s", "trainable_tok_s", "train_tflop_s", "mfu",
                "sync_s", "sync_gib", "peak_mem_gib", "gap_max_abs", "gap_probe_max_abs",
                "gap_kl")


class _NoRay(types.ModuleType):
    """Stands in for `ray`, absent on the GPU machine: the embedded path uses none of it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"bench/gpu_check.py runs without Ray, but ray.{name} was used")


def _setup_paths() -> None:
    sys.path[:0] = [str(REPO)] + [str(REPO / p) for p in PLUGINS]
    sys.path += [str(w) for w in sorted(WHEELS.glob("*.whl"))]   # only what is missing here
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def import_molt() -> None:
    """Import the core modules with `ray` bound to `_NoRay`, then unbind it: they keep the
    stand-in, everything else (transformers' and accelerate's `find_spec("ray")`) sees no Ray,
    and a later `import ray` fails."""
    had, before = "ray" in sys.modules, sys.modules.get("ray")     # None: blocked (the test)
    sys.modules["ray"] = _NoRay("ray")
    try:
        import molt_core.engines.hf  # noqa: F401
        import molt_core.policy.handle  # noqa: F401
        import molt_core.trainer  # noqa: F401
    finally:
        if had:
            sys.modules["ray"] = before
        else:
            del sys.modules["ray"]


def ray_loaded() -> bool:
    """Whether the real Ray package was imported (the stand-in does not count)."""
    return any(n == "ray" or n.startswith("ray.") for n, m in sys.modules.items()
               if m is not None and not isinstance(m, _NoRay))


# --- child: one shape ---------------------------------------------------------------------------

def _sync(device: Any) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_flops(device: Any) -> dict[str, Any]:
    """Best FLOP/s of a square matmul: bf16 on CUDA, fp32 on the CPU."""
    import torch
    cuda = device.type == "cuda"
    n, dtype, reps = (8192, torch.bfloat16, 20) if cuda else (1024, torch.float32, 8)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = math.inf
    for _ in range(3):
        a @ b
        _sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t) / reps)
    return {"dtype": str(dtype).removeprefix("torch."), "n": n, "tflop_s": 2 * n**3 / best / 1e12}


def build_model(shape: dict, out: Path, device: Any) -> tuple[Path, Any]:
    """A random-init Qwen3 (MoE: with `num_experts`) saved in bf16 (the fp32 phase upcasts)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3MoeConfig
    eos, pad = shape["vocab_size"] - 2, shape["vocab_size"] - 1
    cls = Qwen3MoeConfig if "num_experts" in shape else Qwen3Config
    config = cls(**shape, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[eos], pad_token_id=pad)
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    return out, (config, n_params)


class Agent:
    """Random prompt tokens (one per group, seeded by the task) and a reward that a random-init
    policy varies on (the share of odd sampled ids), in token space: no tokenizer needed."""

    def __init__(self, vocab: int, prompt_len: int) -> None:
        self.vocab, self.prompt_len = vocab, prompt_len

    async def rollout(self, ctx: Any) -> Any:
        from molt_core.trajectory import Trajectory
        rng = random.Random(ctx.task)
        traj = Trajectory()
        traj.add_prompt([rng.randrange(self.vocab - 2) for _ in range(self.prompt_len)])
        c = await ctx.generate(traj.token_ids, ctx.sampling)
        traj.add_completion(c)
        traj.reward = sum(t % 2 for t in c.token_ids) / max(len(c.token_ids), 1)
        return traj


class _Registry:
    """What `trainer.train_step` asks of `Plugins` (`get(kind, name)`)."""

    def __init__(self, entries: dict[str, dict[str, Any]]) -> None:
        self.entries = entries

    def get(self, kind: str, name: str) -> Any:
        return self.entries[kind][name]


def in_process_policy(cfg: Any, threads: int) -> Any:
    """`Policy` with its one rank in this process (the `trainer.in_driver` layout, which its
    constructor allows on CPU only and starts through Ray's placement helpers)."""
    from dataclasses import asdict

    import torch
    from molt_core.policy.handle import Policy, _InDriver
    from molt_core.policy.worker import PolicyWorker
    from molt_core.run import cluster
    policy = Policy.__new__(Policy)
    policy.cfg, policy.replicas, policy._prox, policy._pg = cfg.trainer, 1, None, None
    policy.nonfinite_steps = policy._nonfinite_run = 0
    policy.in_driver, policy._threads, policy.workers = True, torch.get_num_threads(), []
    policy._store = cluster.rendezvous("127.0.0.1", cfg.trainer.timeout_s)
    policy.workers = [_InDriver(PolicyWorker(
        0, 1, "127.0.0.1", policy._store.port, cfg.model.path, dtype=cfg.model.dtype,
        trainer=asdict(cfg.trainer), seed=cfg.seed, num_threads=threads))]
    return policy


def push(policy: Any, engine: Any, generator: Any, version: int, bucket_bytes: int,
         device: Any) -> dict[str, float]:
    """The trainer's gathered weights (LoRA: merged; the engine's dtype) copied bucket by bucket
    into the in-process engine on its event loop, then `finish_weight_update` (all assigned)."""
    t0, total, bucket, size = time.perf_counter(), 0, [], 0
    worker = policy.workers[0].worker

    def flush() -> None:
        generator.submit(engine.update_weights(bucket, version)).result(timeout=300)

    for name, t in worker._named_full_tensors():
        if bucket and size + t.numel() * t.element_size() > bucket_bytes:
            flush()
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
    flush()
    generator.submit(engine.finish_weight_update(version)).result(timeout=300)
    _sync(device)
    return {"seconds": time.perf_counter() - t0, "gib": total / 2**30}


def train_flops(config: Any, geo: dict, lora: bool) -> float:
    """Model FLOPs of one step's update (no recomputation counted): per group the shared prompt
    once and every row's completion, matmuls 2 x active params per token, attention 4 x heads x
    head_dim per (query, key) pair (causal), lm_head only at trainable tokens; backward 2x the
    forward (full fine-tuning) or 1x (LoRA: input gradients only, the adapters negligible)."""
    d, heads, kv, hd = (config.hidden_size, config.num_attention_heads,
                        config.num_key_value_heads, config.head_dim)
    attn = d * hd * (2 * heads + 2 * kv)
    if getattr(config, "num_experts", 0):       # the router and the k experts a token uses
        k, inner = config.num_experts_per_tok, config.moe_intermediate_size
        mlp = d * (config.num_experts + k * 3 * inner)
    else:
        mlp = 3 * d * config.intermediate_size
    L, g, P, C = config.num_hidden_layers, geo["group_size"], geo["prompt"], geo["new"]
    body_tokens = P + g * C
    pairs = P * (P + 1) / 2 + g * (C * P + C * (C + 1) / 2)
    fwd = (2 * L * (attn + mlp) * body_tokens + 4 * L * heads * hd * pairs
           + 2 * d * config.vocab_size * g * C)
    return geo["groups"] * fwd * (2 if lora else 3)


async def _cancel(task: Any) -> None:
    import asyncio
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def peak_mem_gib(device: Any) -> float:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_phase(name: str, model_dir: Path, model_info: tuple, device: Any, geo: dict,
              peak: dict, threads: int, steps: int, log: Any) -> dict[str, Any]:
    import torch
    from molt_core.advantage import training_batch
    from molt_core.config import load_config
    from molt_core.engines.hf import HFEngine
    from molt_core.policy.handle import _InDriver
    from molt_core.rollout.generator import Generator
    from molt_core.consistency import probe_consistency
    from molt_core.trainer import train_step
    from molt_grpo import grpo_advantages, ppo_clip_loss

    dtype, lora_rank, _, _ = PHASES[name]
    config, _ = model_info
    cfg = load_config(None, [
        f"model.path={model_dir}", f"model.dtype={dtype}", "engine.name=hf",
        f"rollout.groups_per_step={geo['groups']}", f"rollout.group_size={geo['group_size']}",
        f"sampling.max_new_tokens={geo['new']}", f"trainer.micro_batch_size={geo['micro']}",
        f"trainer.logprob_chunk={geo['chunk']}", f"trainer.lora.rank={lora_rank}",
        f"trainer.lr={1e-4 if lora_rank else 1e-5}", f"trainer.steps={steps}"])
    registry = _Registry({"loss": {"ppo_clip": ppo_clip_loss}})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    policy = engine = generator = None
    rows, peaks = [], []
    try:
        t = time.perf_counter()
        policy = in_process_policy(cfg, threads)
        engine = HFEngine(str(model_dir), dtype=dtype, max_batch_size=256, seed=1000,
                          num_threads=threads, device=str(device))
        generator = Generator(Agent(config.vocab_size, geo["prompt"]), [_InDriver(engine)], cfg,
                              None, config.vocab_size)
        generator.sampling["stop_token_ids"] = []      # every completion runs to max_new_tokens
        build_s = time.perf_counter() - t
        log(f"{name}: trainer and engine built in {build_s:.1f} s")
        version, flops = 0, train_flops(config, geo, bool(lora_rank))
        for step in range(steps):
            t0 = time.perf_counter()
            groups = generator.generate(geo["groups"])
            t1 = time.perf_counter()
            trajs = [t for g in groups for t in g]
            batch, _, _ = training_batch(trajs, grpo_advantages, cfg.algorithm, policy,
                                         cfg.sampling.temperature, config.pad_token_id)
            peaks.append(peak_mem_gib(device))
            _sync(device)
            t2 = time.perf_counter()
            metrics = policy.train(batch, train_step(cfg, registry, step, version))
            _sync(device)
            t3 = time.perf_counter()
            version += 1
            sync = push(policy, engine, generator, version, 64 * 2**20, device)
            peaks += [metrics.get("memory/trainer_peak_gib", 0.0), peak_mem_gib(device)]
            generated = sum(t.num_trainable for t in trajs)
            row = {"step": step, "generate_s": t1 - t0, "train_s": t3 - t2,
                   "sync_s": sync["seconds"], "sync_gib": sync["gib"],
                   "generated_tokens": generated,
                   "train_tokens": int(batch["attention_mask"].sum()),
                   "trainable_tokens": int(batch["loss_mask"].sum()),
                   "gap_max_abs": metrics["mismatch/max_abs"], "gap_kl": metrics["mismatch/kl"],
                   "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
            rows.append(row)
            log(f"{name} step {step}: generate {row['generate_s']:.2f} s, train "
                f"{row['train_s']:.2f} s, sync {row['sync_s']:.2f} s, gap "
                f"{row['gap_max_abs']:.2e}")
        probe = probe_consistency(generator, policy, version, cfg.sampling.temperature)
        peaks.append(peak_mem_gib(device))
    finally:
        if generator is not None:
            if engine is not None and engine._loop_task is not None:   # its decode loop
                generator.submit(_cancel(engine._loop_task)).result(timeout=30)
            generator.close()
        if policy is not None:
            policy.shutdown()
        elif torch.distributed.is_initialized():     # the rank failed half-built
            torch.distributed.destroy_process_group()
        del policy, engine, generator
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    warm = rows[1:] or rows        # step 0 pays the kernels' first calls

    def rate(key: str, over: str) -> float:
        return sum(r[key] for r in warm) / sum(r[over] for r in warm)
    train_tflop_s = flops / statistics.median(r["train_s"] for r in warm) / 1e12
    return {"dtype": dtype, "lora_rank": lora_rank, "steps": steps, "geometry": geo,
            "build_s": build_s,
            "gen_tok_s": rate("generated_tokens", "generate_s"),
            "train_tok_s": rate("train_tokens", "train_s"),
            "trainable_tok_s": rate("trainable_tokens", "train_s"),
            "train_tflop_s": train_tflop_s, "mfu": train_tflop_s / peak["tflop_s"],
            "sync_s": statistics.median(r["sync_s"] for r in warm),
            "sync_gib": rows[-1]["sync_gib"],
            "peak_mem_gib": max(peaks), "gap_max_abs": max(r["gap_max_abs"] for r in rows),
            "gap_probe_max_abs": probe, "gap_kl": max(r["gap_kl"] for r in rows),
            "train_flops_per_step": flops, "rows": rows, "error": None}


def child(args: argparse.Namespace) -> None:
    """One shape: its model, the matmul peak, every phase; the JSON rewritten after each."""
    import torch
    import transformers
    import_molt()
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    geo = GEOMETRY["cpu" if args.dry_run else "cuda"]
    threads = torch.get_num_threads()
    path = Path(args.out) / f"shape-{args.child}.json"
    result: dict[str, Any] = {
        "shape": args.child, "config": shapes[args.child], "device": str(device),
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": threads, "phases": {}, "error": None}

    def log(msg: str) -> None:
        print(f"[{args.child} {time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    def save() -> None:
        result.update(ray_loaded=ray_loaded(), wall_s=time.perf_counter() - start,
                      modules=sorted({n.split(".")[0] for n in sys.modules}))
        path.write_text(json.dumps(result, indent=1, default=str))

    models = Path(tempfile.mkdtemp(prefix="molt-gpu-check-"))   # never under OUT: it travels
    try:
        result["peak"] = peak_flops(device)
        log(f"matmul peak {result['peak']['tflop_s']:.2f} TFLOP/s ({result['peak']['dtype']})")
        t = time.perf_counter()
        model_dir, info = build_model(shapes[args.child], models / args.child,
                                      device)
        result["params"] = info[1]
        log(f"model: {info[1] / 1e6:.1f}M parameters, built and saved in "
            f"{time.perf_counter() - t:.1f} s")
    except Exception:
        result["error"] = traceback.format_exc()
        save()
        shutil.rmtree(models, ignore_errors=True)
        raise
    save()
    for name, (_, _, cuda_steps, dry_steps) in PHASES.items():
        left = args.deadline - time.time()
        if left < (5 if args.dry_run else 45):
            result["phases"][name] = {"error": f"skipped: {left:.0f} s of the budget left"}
            log(f"{name}: skipped, {left:.0f} s left")
            continue
        try:
            result["phases"][name] = run_phase(name, model_dir, info, device, geo,
                                               result["peak"], threads,
                                               dry_steps if args.dry_run else cuda_steps, log)
        except Exception:
            result["phases"][name] = {"error": traceback.format_exc()}
            log(f"{name} FAILED:\n{result['phases'][name]['error']}")
        save()
    for key, want in (("gap_bf16", "bfloat16"), ("gap_fp32", "float32")):
        gaps = [max(p["gap_max_abs"], p["gap_probe_max_abs"])
                for p in result["phases"].values() if p.get("dtype") == want]
        result[key] = max(gaps) if gaps else None
    save()
    shutil.rmtree(models, ignore_errors=True)


# --- parent: every shape, the table -------------------------------------------------------------

def table(shapes: dict[str, dict]) -> str:
    head = (f"{'shape':14} {'phase':10} {'gen tok/s':>10} {'train tok/s':>11} {'TFLOP/s':>8} "
            f"{'MFU':>6} {'sync s':>7} {'peak GiB':>8} {'gap max':>9} {'probe':>9}")
    lines = [head, "-" * len(head)]
    for shape, r in shapes.items():
        if r.get("error") and not r.get("phases"):
            lines.append(f"{shape:14} FAILED: {r['error'].strip().splitlines()[-1][:80]}")
            continue
        for phase, p in r.get("phases", {}).items():
            if p.get("error"):
                lines.append(f"{shape:14} {phase:10} {p['error'].strip().splitlines()[-1][:80]}")
                continue
            lines.append(f"{shape:14} {phase:10} {p['gen_tok_s']:10.0f} {p['train_tok_s']:11.0f} "
                         f"{p['train_tflop_s']:8.3f} {p['mfu']:6.1%} {p['sync_s']:7.3f} "
                         f"{p['peak_mem_gib']:8.2f} {p['gap_max_abs']:9.2e} "
                         f"{p['gap_probe_max_abs']:9.2e}")
        peak = r.get("peak", {})
        lines.append(f"{shape:14} matmul peak {peak.get('tflop_s', float('nan')):.2f} TFLOP/s "
                     f"({peak.get('dtype')}); log-prob gap bf16 {r.get('gap_bf16')}, "
                     f"fp32 {r.get('gap_fp32')}")
    return "\n".join(lines)


def run_child(name: str, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Shape `name` in a child process given the budget's rest; its JSON, with any failure."""
    left = deadline - time.time()
    if left < 60:
        print(f"=== {name}: skipped, {left:.0f} s of the budget left", flush=True)
        return {"phases": {}, "error": f"skipped: {left:.0f} s of the budget left"}
    cmd = [sys.executable, __file__, "--child", name, "--out", args.out,
           "--deadline", str(deadline)] + (["--dry-run"] if args.dry_run else [])
    print(f"=== {name} ({left:.0f} s of the budget left)", flush=True)
    try:
        rc: Any = subprocess.run(cmd, timeout=left + 30).returncode
    except subprocess.TimeoutExpired:
        rc = "a timeout (killed)"
    path = Path(args.out) / f"shape-{name}.json"
    shape = json.loads(path.read_text()) if path.exists() else {"phases": {}}
    if rc != 0:
        shape["error"] = shape.get("error") or f"child process ended with {rc}"
    return shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", default=os.environ.get("OUT"), help="default: $OUT")
    p.add_argument("--shapes", help="comma-separated subset of the shapes")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-time budget of the whole check (default: 420 on GPU, 300 dry run)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.out:
        p.error("give --out DIR or set $OUT")
    _setup_paths()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.child:
        return child(args)
    start = time.time()
    deadline = start + (args.budget_s or (300 if args.dry_run else 420))
    names = args.shapes.split(",") if args.shapes else list(DRY_SHAPES if args.dry_run else SHAPES)
    result: dict[str, Any] = {"dry_run": args.dry_run, "shapes": {}, "python": sys.version}
    for name in names:
        result["shapes"][name] = run_child(name, args, deadline)
        result["ray_loaded"] = any(s.get("ray_loaded", False) for s in result["shapes"].values())
        result["wall_s"] = time.time() - start
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(table(result["shapes"]), flush=True)
    print(f"wall {result['wall_s']:.0f} s; JSON: {Path(args.out) / 'gpu_check.json'}", flush=True)
    failed = [n for n, s in result["shapes"].items()
              if s.get("error") or any(p.get("error") for p in s["phases"].values())]
    if failed:
        print(f"FAILED in {', '.join(failed)}: see the errors above and in the JSON", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
