"""Trainer backend `fsdp2`, one rank: an HF causal LM sharded with torch `fully_shard`
(gloo on CPU, NCCL on CUDA), run by `policy.handle.Policy` as a Ray actor or, for one CPU rank
reserving nothing, in the driver's process (`trainer.in_driver`). World size 1 runs the same FSDP2
code path as world size N, but for LoRA on one CPU rank: a plain module there (`_build_model`)."""

from __future__ import annotations

import ctypes
import functools
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard, register_fsdp_forward_method)
from torch.distributed.tensor import DTensor

from molt_core import lora, moe, multimodal, weight_sync
from molt_core.policy.logprobs import Forward, fast_norms, token_logprobs
from molt_core.policy.objective import Tally, TrainStep, needs_reference, objective
from molt_core.run import checkpoint as ckpt

__all__ = ["PolicyWorker", "gathered", "lr_factor", "param_groups"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """`module`'s trainable parameters as AdamW groups, HF Trainer's way: no decay for names
    matching `_NO_DECAY` (biases, norm weights; FSDP2 and LoRA keep HF's names) nor LayerNorms."""
    ln = {id(p) for m in module.modules() if isinstance(m, torch.nn.LayerNorm)
          for p in m.parameters()}
    groups = [{"params": [], "weight_decay": weight_decay}, {"params": [], "weight_decay": 0.0}]
    for n, p in module.named_parameters():
        if p.requires_grad:
            groups[id(p) in ln or bool(_NO_DECAY.search(n.lower()))]["params"].append(p)
    return [g for g in groups if g["params"]]


def lr_factor(t: dict[str, Any]) -> Callable[[int], float]:
    """lr's factor at optimizer step s under `trainer.lr_schedule` (HF's schedules, warmup)."""
    warm, total = t["warmup_steps"], t["steps"] * t["mini_batches"] * t["epochs"]
    rest = max(1, total - warm)
    after = {"constant": lambda s: 1.0, "linear": lambda s: max(0.0, (total - s) / rest),
             "cosine": lambda s: max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((s - warm) / rest))))}
    return lambda s: s / max(1, warm) if s < warm else after[t["lr_schedule"]](s)


class PolicyWorker:
    share_context = False                # token_logprobs' shared contexts (`_build_model`)

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 model_path: str, *, dtype: str = "float32", trainer: dict[str, Any],
                 seed: int = 0, num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.rank, self.world_size, self.cfg = rank, world_size, trainer
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
        if not cuda and hasattr(libc := ctypes.CDLL(None), "mallopt"):
            # glibc gives each freed block over 32 MiB back to the OS and faults the next one's
            # pages in again ([512, 49152] fp32 log_softmax: 31 ms, 7 ms in kept memory)
            libc.mallopt(-4, 0), libc.mallopt(-1, 1 << 30)   # M_MMAP_MAX, M_TRIM_THRESHOLD
        timeout = timedelta(seconds=trainer["timeout_s"])
        store = dist.TCPStore(master_addr, master_port, world_size, False, timeout=timeout)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        self.grad_scale = world_size        # FSDP2 averages grads over ranks: see train_step
        model = self._build_model(model_path, _DTYPES[dtype])
        gate_params = {id(p) for g in moe.moe_gates(model) for p in g.parameters()}
        self.fp32_names = {n for n, p in model.named_parameters() if id(p) in gate_params}
        self.model = _with_forward(model, self.share_context)
        self.model_path, self.dtype = model_path, dtype
        self.reference: Any = None                       # frozen initial weights (KL), lazy
        self.value_head: torch.nn.Linear | None = None   # the critic, lazy
        self.optim = torch.optim.AdamW(param_groups(model, trainer["weight_decay"]),
                                       lr=trainer["lr"], betas=tuple(trainer["betas"]),
                                       eps=trainer["eps"], fused=True)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optim, lr_factor(trainer))

    def _build_model(self, model_path: str, dtype: torch.dtype) -> torch.nn.Module:
        """The HF model, each decoder layer and the root `fully_shard` over all ranks
        (`trainer.optimizer_offload`: params, grads and AdamW state live on the CPU). Parameters
        and AdamW stay fp32 (master weights; with LoRA only the adapters train, fp32); forward and
        backward run in `dtype` (FSDP2 mixed precision), routers in fp32."""
        lora_rank = self.cfg["lora"]["rank"]
        carry = Path(model_path, "driver.pt").is_file()     # a checkpoint: model.init_lora carry
        arch = json.loads(Path(model_path, "meta.json").read_text())["model_path"] if carry \
            else model_path
        model = multimodal.load_model(arch, dtype if lora_rank else torch.float32)
        moe.keep_router_fp32(model)     # frozen LoRA bases load in `dtype`, routers stay fp32
        fast_norms(model)
        model = model.to(self.device)
        if lora_rank:
            model = lora.add_adapters(model, self.cfg["lora"])
        if carry:                       # its weights, base and adapters, in place
            dcp.load({f"model.policy.{k}": v for k, v in model.state_dict().items()},
                     checkpoint_id=Path(model_path) / "policy")
        for gate in moe.moe_gates(model):
            gate.requires_grad_(self.cfg["moe_routing"] != "freeze_router")
        # One rank, text models: the layers stay unsharded through the step (`_reshard` before the
        # optimizer) so token_logprobs may run a shared context apart from the rows continuing it
        # (two forwards of a layer per backward; VL models keep mRoPE state from one to the next)
        self.share_context = self.world_size == 1 and not multimodal.is_vl(model.config)
        lora.drop_merged(model, keep=self.share_context and self.device.type == "cpu")
        if self.world_size == 1 and lora_rank and self.device.type == "cpu":
            # nothing to shard, the frozen base already in `dtype`, adapters and routers cast where
            # used (`lora`, `moe`): no FSDP2, whose per-layer hooks, all-gather copies and DTensor
            # dispatch were ~15 % of a SmolLM2 LoRA step (same losses and grad norms, A/B)
            return model
        offload = (CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
                   if self.cfg["optimizer_offload"] else OffloadPolicy())

        mesh = init_device_mesh(self.device.type, (self.world_size,))

        def shard(module: torch.nn.Module, cast_inputs: bool = True) -> None:
            fully_shard(module, mesh=mesh, offload_policy=offload, mp_policy=MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs))

        for gate in moe.moe_gates(model):    # own group, no cast: fp32 among bf16 compute
            fully_shard(gate, mesh=mesh, offload_policy=offload)
        for layer in multimodal.decoder_layers(model):
            shard(layer)
        # the root's inputs stay as given (a forward method's batch: pixel values not cast)
        shard(model, cast_inputs=False)
        # A param without grad on one rank (unrouted expert, idle lm_head) must not shrink its
        # reduce-scatter: unequal collectives hang.
        model.set_reduce_scatter_unused_params(True)
        model.set_reshard_after_forward(not self.share_context)
        model.set_reshard_after_backward(not self.share_context)
        return model

    def ready(self) -> int:
        return self.rank

    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """`micro_batch_size` rows each, a cut that would split a rollout moved to its nearest
        rollout start short of a neighbour cut (a sequence ratio spans the rollout's segments):
        the count, equal on every rank, stays."""
        B, n, r = batch["input_ids"].shape[0], self.cfg["micro_batch_size"], batch.get(
            "rollout_index")
        r, cuts = [0] * B if r is None else r.reshape(-1).tolist(), [0]
        for c in range(n, B, n):
            starts = [b for b in range(cuts[-1] + 1, min(c + n, B)) if r[b - 1] != r[b]]
            cuts.append(c if r[c - 1] != r[c] or not starts else min(
                starts, key=lambda b: (abs(b - c), b)))
        for s, e in zip(cuts, cuts[1:] + [B]):
            mb = {k: _tensor(v[s:e]).to(self.device) for k, v in batch.items()}
            T = max(int(mb["attention_mask"].sum(-1).max()), 1)    # right padded: trim the tail
            yield {k: v if k in _IMAGE_KEYS else v[:, :T] for k, v in mb.items()}

    def _forward(self, mb: dict[str, torch.Tensor], temperature: float,
                 value_head: torch.nn.Module | None = None, model: Any = None) -> Forward:
        model = model or self.model
        if self.device.type == "cpu" and self.dtype != "float32":
            # bf16 rows of <= 256 tokens: eager attention (matmuls; `logprobs._grouped_eager`)
            # runs 2-4x faster than SDPA's flash kernel on CPU, which wins on longer rows
            long = mb["input_ids"].shape[1] > 256
            model.config._attn_implementation = "sdpa" if long else "molt_eager"
        return model.molt_token_logprobs(
            mb, temperature, self.cfg["logprob_chunk"], moe_routing=self.cfg["moe_routing"],
            value_head=value_head)

    def _reference(self) -> Any:
        """pi_ref for the KL term: the initial weights, frozen, built and sharded as the policy."""
        if self.reference is None:
            ref = self._build_model(self.model_path, _DTYPES[self.dtype]).requires_grad_(False)
            self.reference = _with_forward(ref, self.share_context).eval()
        return self.reference

    def _critic(self) -> torch.nn.Linear:
        """The critic: a zero-initialised Linear(hidden, 1) on the policy's detached final hidden
        states, replicated on every rank (outside FSDP; its grads are all-reduced by hand)."""
        if self.value_head is None:
            hidden = self.model.config.get_text_config().hidden_size
            head = torch.nn.Linear(hidden, 1, device=self.device)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            for g in (groups := param_groups(head, self.cfg["weight_decay"])):
                self.optim.add_param_group(g)      # LambdaLR steps every group (lr: train_step)
                self.schedule.base_lrs.append(self.cfg["lr"])
                self.schedule.lr_lambdas.append(self.schedule.lr_lambdas[0])
            self.value_head, self.critic_groups = head, self.optim.param_groups[-len(groups):]
        return self.value_head

    def train_step(self, batch: dict[str, torch.Tensor], spec: TrainStep, num_tokens: int,
                   num_seqs: int) -> dict[str, Any]:
        """One optimizer step of `spec` on this rank's rows (`num_tokens`/`num_seqs`: the step's
        global counts; the loss: `objective`); returns mergeable sums, counts and maxima. pi_prox
        is `batch["prox_logprobs"]`, the log-probs before the rollout batch's first optimizer step
        (`Policy.train`), or with one step per batch this forward's own, detached. A non-finite
        loss or grad norm on any rank skips the step on all (`nonfinite`), and so does an exactly
        zero gradient (`no_signal`: every advantage 0 and no term with a gradient of its own)."""
        t0 = time.perf_counter()
        critic = self._critic() if "returns" in batch else None
        lr = self.optim.param_groups[0]["lr"]            # this step's (`schedule`)
        for g in self.critic_groups if critic is not None else ():     # on the same schedule
            g["lr"] = lr / self.cfg["lr"] * ((spec.terms or {}).get("value_lr") or self.cfg["lr"])
        tally, loss_total, trained = Tally(), 0.0, []   # trained: pre-update log-probs
        for mb in self._micro_batches(batch):
            fwd = self._forward(mb, spec.temperature, critic)
            lp = fwd.logprobs.detach()
            trained.append(F.pad(lp, (0, batch["input_ids"].shape[1] - lp.shape[1])))
            ref = self._ref_forward(mb, spec.temperature) if needs_reference(spec) else None
            loss, metrics = objective(spec, mb, fwd, num_tokens, num_seqs, ref_logprobs=ref,
                                      aux_coef=self.cfg["moe_aux_loss_coef"])
            # FSDP2 averages grads over ranks; x grad_scale makes the step's grad sum/global count.
            (loss * self.grad_scale).backward()
            loss_total += float(loss.detach())
            tally.add(mb, fwd, metrics, spec.version)
        t1 = time.perf_counter()
        grad_norm, finite, signal = self._optimizer_step(loss_total, critic)
        return {"loss": loss_total, "grad_norm": grad_norm, "lr": lr, "sums": tally.sums,
                "counts": tally.counts,
                "max": {"mismatch/max_abs": tally.max_abs, "memory/trainer_peak_gib": _peak_gib()},
                "nonfinite": not finite, "no_signal": finite and not signal,
                # pi_prox given: the driver has them
                "logprobs": None if "prox_logprobs" in batch else torch.cat(trained).cpu().numpy(),
                "time": {"train/fwd_bwd_s": t1 - t0, "train/optim_s": time.perf_counter() - t1}}

    def _optimizer_step(self, loss: float, critic: torch.nn.Module | None
                        ) -> tuple[float, bool, bool]:
        """Clip, all-reduce the critic's grads, step unless non-finite or the gradient is exactly
        zero; (grad norm, finite, nonzero)."""
        _reshard(self.model)              # before the grads and the optimizer: the shards
        grad_norm, critic_norm = self._clip_grads(), 0.0
        if critic is not None:
            for p in critic.parameters():     # loss x world_size: SUM / world_size
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                dist.all_reduce(p.grad)
                p.grad /= self.world_size
            critic_norm = float(torch.nn.utils.clip_grad_norm_(critic.parameters(),
                                                               self.cfg["grad_clip"]))
        if self.reference is not None:
            _reshard(self.reference)
        finite = torch.tensor(float(math.isfinite(loss) and math.isfinite(grad_norm)),
                              device=self.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)      # every rank steps, or none does
        # no learning signal (norms are global): AdamW would still move the weights on its
        # momentum and decay, and the moments would change
        signal = grad_norm > 0 or critic_norm > 0
        if finite.item() and signal:
            self.optim.step()
            self.schedule.step()          # as HF's: a skipped step does not advance it
        self.optim.zero_grad(set_to_none=True)
        return float(grad_norm), bool(finite.item()), signal

    def _clip_grads(self) -> float:
        """Clip the step's gradients to `trainer.grad_clip`; returns their total norm."""
        return float(gathered(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                             self.cfg["grad_clip"])))

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                 with_routing: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[b, T] trainer log-probs of trainable tokens (0 elsewhere), pre-update weights;
        `with_routing` (MoE): also the [b, T, layers, k] expert ids the forward used (-1: pad)."""
        T, ids = batch["input_ids"].shape[1], []

        def fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
            fwd = self._forward(mb, temperature)
            if with_routing and fwd.expert_ids is not None:     # [b, t, L, k] -> [b, T, L, k]
                u = fwd.expert_ids.cpu().to(torch.int32)
                ids.append(F.pad(u, (0, 0, 0, 0, 0, T - u.shape[1]), value=-1))
            return fwd.logprobs
        out = self._per_token(batch, self.model, fn)
        return (out, torch.cat(ids) if ids else None) if with_routing else out

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[b, T] the critic's values of the states before trainable tokens (0 elsewhere)."""
        return self._per_token(batch, self.model,
                               lambda mb: self._forward(mb, 1.0, self._critic()).values)

    @torch.no_grad()
    def ref_logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0
                     ) -> torch.Tensor:
        """[b, T] log-probs of trainable tokens under pi_ref (the frozen initial weights)."""
        return self._per_token(batch, self._reference(),
                               lambda mb: self._ref_forward(mb, temperature))

    @torch.no_grad()
    def _ref_forward(self, mb: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        return self._forward(mb, temperature, model=self._reference()).logprobs

    def _per_token(self, batch: dict[str, torch.Tensor], model: Any,
                   fn: Callable[[dict], torch.Tensor]) -> torch.Tensor:
        B, T = batch["input_ids"].shape
        out, s = torch.zeros(B, T), 0
        for mb in self._micro_batches(batch):
            x = fn(mb).cpu()
            out[s:s + x.shape[0], :x.shape[1]] = x
            s += x.shape[0]
        _reshard(model)
        return out

    def save_checkpoint(self, path: str) -> bool:
        """This rank's shards of model, AdamW, critic and lr schedule in `path`/policy (DCP,
        collective), its RNG in `path`/rng_rank{r}.pt (`run.checkpoint`'s layout); True: critic."""
        msd, osd = get_state_dict(self._stateful(), self.optim)
        dcp.save({"model": msd, "optim": osd, "schedule": self.schedule.state_dict()},
                 checkpoint_id=Path(path) / "policy")
        torch.save(ckpt.rng_state(), Path(path) / f"rng_rank{self.rank}.pt")
        return self.value_head is not None

    def load_checkpoint(self, path: str, critic: bool) -> None:
        """What `save_checkpoint` wrote (`critic`: what it returned)."""
        if critic:
            self._critic()                 # its param group must exist before AdamW state loads
        mods = self._stateful()
        state = dict(zip(("model", "optim"), get_state_dict(mods, self.optim)))
        state["schedule"] = self.schedule.state_dict()
        dcp.load(state, checkpoint_id=Path(path) / "policy")
        set_state_dict(mods, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.schedule.load_state_dict(state["schedule"])
        ckpt.set_rng_state(torch.load(Path(path) / f"rng_rank{self.rank}.pt", weights_only=True))

    def _stateful(self) -> torch.nn.Module:
        critic = {} if self.value_head is None else {"critic": self.value_head}
        return torch.nn.ModuleDict({"policy": self.model, **critic})

    def _named_full_tensors(self, merge: bool = True, master: bool = False
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """Gathered parameters; with LoRA and `merge`, the merged HF weights (`lora.merged`); in
        the engines' dtypes (`model.dtype`, routers fp32) unless `master` (the fp32 masters)."""
        named = ((name, gathered(p).detach()) for name, p in self.model.named_parameters())
        cfg = self.cfg["lora"]
        named = lora.merged(named, cfg["alpha"] / cfg["rank"]) if merge and cfg["rank"] else named
        dtype = _DTYPES[self.dtype]
        return ((n, t if master or n in self.fp32_names else t.to(dtype)) for n, t in named)

    def full_params(self, adapter: bool = False, master: bool = False) -> dict[str, torch.Tensor]:
        """Gathered parameters by HF name (LoRA: merged), or with `adapter` only the LoRA weights
        by PEFT's saved names (a collective: on every rank); `master`: fp32, not engine dtypes."""
        if adapter:
            return lora.adapter_tensors(self._named_full_tensors(merge=False, master=True))
        return {n: t.cpu() for n, t in self._named_full_tensors(master=master)}

    def push_weights(self, engines: list, version: int, bucket_bytes: int, timeout_s: float,
                     transport: str = "ray") -> dict[str, Any]:
        """Gather every parameter (all ranks; LoRA `sync: adapter`: the adapters only, as
        `lora.adapter_sync`); rank 0 sends dtype-preserving buckets to engines (`weight_sync.send`)
        over Ray or the process group / shared-memory channel (`broadcast`/`shm`) built on the
        first push to these engines."""
        cfg = self.cfg["lora"]
        named = (lora.adapter_sync(((n, gathered(p).detach()) for n, p in
                                    self.model.named_parameters() if ".lora_" in n),
                                   cfg["alpha"] / cfg["rank"])       # fp32 masters
                 if cfg["rank"] and cfg["sync"] == "adapter" else self._named_full_tensors())
        try:
            if self.rank != 0:
                return {}
            group = None
            if transport in ("broadcast", "shm"):
                key = [e._actor_id for e in engines]
                if getattr(self, "_group_key", None) != key:
                    self._group, self._group_key = weight_sync.connect(engines, timeout_s,
                                                                       transport), key
                group = self._group
            return weight_sync.send(named, engines, version, bucket_bytes, timeout_s, group)
        except Exception:
            self._group_key = None      # a failed collective leaves the group unusable
            raise
        finally:
            # each gather is a collective: ranks that send nothing, or whose send failed, finish
            # them so the other ranks stay in step
            for _ in named:
                pass


_IMAGE_KEYS = ("pixel_values", "image_grid_thw")   # per row, not per token (collate)


def _peak_gib() -> float:
    """This step's peak allocated GPU memory, or on CPU the rank's peak RSS so far (GiB)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return peak / 2**30
    try:    # VmHWM, not ru_maxrss: that keeps the peak of a parent that forked this process
        return next(int(ln.split()[1]) for ln in Path("/proc/self/status").read_text(
            ).splitlines() if ln.startswith("VmHWM:")) / 2**20          # KiB
    except (OSError, StopIteration):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _reshard(model: Any) -> None:
    """Free gathered params: the root keeps its own after forward, on one rank every layer does
    through the step (`_build_model`)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    lora.drop_merged(model)


def _with_forward(model: Any, share_context: bool) -> Any:
    """`model.molt_token_logprobs`: `token_logprobs` as an FSDP2 forward method (the root owns
    embed/norm/lm_head: gathered only inside a registered forward method)."""
    model.molt_token_logprobs = functools.partial(token_logprobs, model,
                                                  share_context=share_context)
    register_fsdp_forward_method(model, "molt_token_logprobs")
    return model


def gathered(x: Any) -> Any:
    """The full tensor of a DTensor (a collective over its mesh); anything else as is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def _tensor(x: Any) -> torch.Tensor:
    return torch.tensor(x) if isinstance(x, np.ndarray) else x   # copied: Ray's is read-only


