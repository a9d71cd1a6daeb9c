"""Bytes and seconds per LoRA weight sync, `trainer.lora.sync` merged vs adapter, side by side in
one process (issue 43, acceptance 1).

Two trainers (`Policy`, fsdp2, one rank each as a Ray actor) with the same LoRA (all-linear) on
the model, one hf engine (Ray actor) each; each round pushes both, alternating which goes first,
over `--transport`. Reported per mode: the bytes `weight_sync.send` sent, its seconds (rank 0's
send: buckets, engine loads, checksums, finish) and the CPU seconds of the sender and the engine
process for the push (getrusage in each actor; the box is shared: trust CPU more than wall). After
the pushes both engines score one text against the trainer (adapter vs merged log-probs, fp32).
Then the bytes for Qwen3-30B-A3B at rank 32 from its config (no download): `qwen3_moe_bytes`.

    python bench/lora_sync.py [--model .cache/smollm2-135m-instruct] [--rank 16] [--repeats 3]
                              [--transport shm|broadcast|ray]
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import tempfile

import ray
import torch

# Qwen/Qwen3-30B-A3B config.json (the fields that size the weights)
QWEN3_30B_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
                     moe_intermediate_size=768, tie_word_embeddings=False)


def qwen3_moe_bytes(c: dict, rank: int) -> dict[str, int]:
    """Per sync: `adapter` = A [r, in] + B [out, r] in fp32 (the trainer's masters) of q/k/v/o in
    every layer (the experts and routers stay frozen, as `lora._targets` leaves them) + 4 (the
    scaling); `merged` = every weight in bf16, the routers in fp32 (`moe.keep_router_fp32`)."""
    h, n, q, kv = (c["hidden_size"], c["num_hidden_layers"],
                   c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"])
    shapes = [(h, q), (h, kv), (h, kv), (q, h)]                       # (in, out): q k v o
    lora = n * sum(rank * (i + o) for i, o in shapes)
    attn = sum(i * o for i, o in shapes) + 2 * c["head_dim"]           # + q_norm, k_norm
    experts = c["num_experts"] * 3 * h * c["moe_intermediate_size"]
    router = c["num_experts"] * h
    embed = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
    bf16 = n * (attn + experts + 2 * h) + embed + h
    return {"lora_params": lora, "adapter": 4 * lora + 4, "params": bf16 + n * router,
            "merged": 2 * bf16 + 4 * n * router}


def _cpu(_self=None) -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".cache/smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transport", default="shm", choices=["shm", "broadcast", "ray"])
    args = ap.parse_args()

    from molt_core.config import LoraConfig, TrainerConfig
    from molt_core.engines.hf import HFEngine
    from molt_core.policy.handle import Policy

    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(dir="/tmp"))
    base = TrainerConfig(in_driver=False, weight_sync_transport=args.transport,
                         lora=LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    modes = ("merged", "adapter")
    pol = {m: Policy(args.model, dataclasses.replace(
        base, lora=dataclasses.replace(base.lora, sync=m)), seed=0) for m in modes}
    eng = {m: ray.remote(HFEngine).options(num_cpus=0).remote(args.model) for m in modes}
    for p in pol.values():      # B != 0, so the merged and the adapted weights differ from base
        ray.get(p.workers[0].__ray_call__.remote(lambda w: [
            t.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
            for n, t in w.model.named_parameters() if ".lora_B." in n]))
    rows: dict[str, list] = {m: [] for m in modes}
    for r in range(args.repeats + 1):                 # round 0 warms up (shm files, groups)
        for m in (modes if r % 2 else modes[::-1]):
            before = ray.get([pol[m].workers[0].__ray_call__.remote(_cpu),
                              eng[m].__ray_call__.remote(_cpu)])
            stats = pol[m].push_weights([eng[m]], r + 1)
            after = ray.get([pol[m].workers[0].__ray_call__.remote(_cpu),
                             eng[m].__ray_call__.remote(_cpu)])
            if r:
                rows[m].append((stats["bytes"], stats["seconds"], after[0] - before[0],
                                after[1] - before[1]))
    ids = list(range(10, 60))
    scores = {m: ray.get(eng[m].score.remote(ids)) for m in modes}
    gap = max(abs(a - b) for a, b in zip(*scores.values()))
    print(f"model {args.model}, LoRA r{args.rank} all-linear, transport {args.transport}, "
          f"{args.repeats} pushes each (median):")
    print("| sync | bytes | s per sync (wall) | sender CPU s | engine CPU s |")
    print("|---|---|---|---|---|")
    for m in modes:
        b, s, cs, ce = (statistics.median(x) for x in zip(*rows[m]))
        print(f"| {m} | {int(b):,} ({b / 2**20:.1f} MiB) | {s:.3f} | {cs:.3f} | {ce:.3f} |")
    print(f"engine log-probs, adapter vs merged, on {len(ids)} tokens: max |diff| {gap:.2e}")
    q = qwen3_moe_bytes(QWEN3_30B_A3B, 32)
    print(f"Qwen3-30B-A3B r32 q/k/v/o: adapter {q['adapter']:,} B ({q['lora_params']:,} params "
          f"fp32), merged {q['merged']:,} B ({q['params']:,} params bf16, routers fp32): "
          f"{q['merged'] / q['adapter']:.0f}x")
    for p in pol.values():
        p.shutdown()


if __name__ == "__main__":
    main()
