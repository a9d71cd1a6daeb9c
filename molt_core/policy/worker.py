"""Trainer backend `fsdp2`, one rank: an HF causal LM sharded with torch `fully_shard`
(gloo on CPU, NCCL on CUDA), run by `policy.handle.Policy` as a Ray actor or, for one CPU rank
reserving nothing, in the driver's process (`trainer.in_driver`). World size 1 runs the same FSDP2
code path as world size N.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard, register_fsdp_forward_method)
from torch.distributed.tensor import DTensor

from molt_core import lora, moe, multimodal, weight_sync
from molt_core.advantage import opt_in
from molt_core.algos import aggregate, is_correction, loss_terms
from molt_core.policy.logprobs import token_logprobs
from molt_core.policy.objective import TrainStep
from molt_core.run import checkpoint as ckpt

__all__ = ["PolicyWorker", "nanmax"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PolicyWorker:
    """One FSDP2 rank. Plain class; `Policy` runs it as a Ray actor (one CPU rank: in the
    driver's process, `trainer.in_driver`)."""

    share_context = False                # token_logprobs' shared contexts (`_build_model`)

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 model_path: str, *, dtype: str = "float32", trainer: dict[str, Any],
                 seed: int = 0, num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.rank, self.world_size, self.cfg = rank, world_size, trainer
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
        dist.init_process_group("nccl" if cuda else "gloo",
                                init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=trainer["timeout_s"]))
        # FSDP2 averages grads over the data-parallel ranks; the loss is scaled back by it.
        self.grad_scale = world_size
        model = self._build_model(model_path, _DTYPES[dtype])
        self.moe = moe.is_moe(model)
        gate_params = {id(p) for g in moe.moe_gates(model) for p in g.parameters()}
        self.fp32_names = {n for n, p in model.named_parameters() if id(p) in gate_params}
        # The root owns embed/norm/lm_head: gathered only inside a registered forward method.
        model.molt_token_logprobs = functools.partial(token_logprobs, model,
                                                      share_context=self.share_context)
        register_fsdp_forward_method(model, "molt_token_logprobs")
        self.model, self.model_path, self.dtype = model, model_path, dtype
        self.reference: Any = None                       # frozen initial weights (KL), lazy
        self.value_head: torch.nn.Linear | None = None   # the critic, lazy
        self.optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                       lr=trainer["lr"],
                                       betas=tuple(trainer["betas"]),
                                       weight_decay=trainer["weight_decay"])

    def _build_model(self, model_path: str, dtype: torch.dtype) -> torch.nn.Module:
        """The HF model, each decoder layer and the root `fully_shard` over all ranks
        (`trainer.optimizer_offload`: params, grads and AdamW state live on the CPU). Parameters
        and AdamW stay fp32 (master weights); forward and backward run in `dtype` (FSDP2
        mixed precision), routers in fp32."""
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # fp32 masters; with LoRA only the adapters train (PEFT keeps them fp32)
        lora_rank = self.cfg["lora"]["rank"]
        model = multimodal.load_model(model_path, dtype if lora_rank else torch.float32)
        model = model.to(self.device)
        if lora_rank:
            model = lora.add_adapters(model, self.cfg["lora"])
        offload = (CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
                   if self.cfg["optimizer_offload"] else OffloadPolicy())

        def shard(module: torch.nn.Module, cast_inputs: bool = True) -> None:
            fully_shard(module, mesh=mesh, offload_policy=offload, mp_policy=MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs))

        for gate in moe.moe_gates(model):    # own group, no cast: fp32 among bf16 compute
            gate.requires_grad_(self.cfg["moe_routing"] != "freeze_router")
            fully_shard(gate, mesh=mesh, offload_policy=offload)
        for layer in multimodal.decoder_layers(model):
            shard(layer)
        # the root's forward method fills the `moe_out`/`extras` dicts it is given: a cast of
        # its inputs would hand it copies
        shard(model, cast_inputs=False)
        # A param without grad on one rank (unrouted expert, idle lm_head) must not shrink its
        # reduce-scatter: unequal collectives hang.
        model.set_reduce_scatter_unused_params(True)
        # One rank, text models: the layers stay unsharded through the step (`_reshard` before the
        # optimizer) so token_logprobs may run a shared context apart from the rows continuing it
        # (two forwards of a layer per backward; VL models keep mRoPE state from one to the next)
        self.share_context = self.world_size == 1 and not multimodal.is_vl(model.config)
        model.set_reshard_after_forward(not self.share_context)
        model.set_reshard_after_backward(not self.share_context)
        return model

    def ready(self) -> int:
        return self.rank

    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        mbs = []
        n = self.cfg["micro_batch_size"]
        for s in range(0, batch["input_ids"].shape[0], n):
            mb = {k: _tensor(v[s:s + n]).to(self.device) for k, v in batch.items()}
            T = max(int(mb["attention_mask"].sum(-1).max()), 1)    # right padded: trim the tail
            mbs.append({k: v if k in _IMAGE_KEYS else v[:, :T] for k, v in mb.items()})
        return mbs

    def _logprobs(self, mb: dict[str, torch.Tensor], temperature: float,
                  moe_out: dict | None = None, extras: dict | None = None,
                  value_head: torch.nn.Module | None = None, model: Any = None) -> torch.Tensor:
        return (model or self.model).molt_token_logprobs(
            mb["input_ids"], mb["attention_mask"], mb["loss_mask"], temperature,
            self.cfg["logprob_chunk"], mb.get("routed_experts"), self.cfg["moe_routing"],
            moe_out, _images(mb), extras, value_head)

    def _reference(self) -> Any:
        """pi_ref for the KL term: the initial weights, frozen, built and sharded like the policy
        (`_build_model`)."""
        if self.reference is None:
            ref = self._build_model(self.model_path, _DTYPES[self.dtype]).requires_grad_(False)
            ref.molt_token_logprobs = functools.partial(token_logprobs, ref,
                                                        share_context=self.share_context)
            register_fsdp_forward_method(ref, "molt_token_logprobs")
            self.reference = ref.eval()
        return self.reference

    def _critic(self) -> torch.nn.Linear:
        """The critic: a zero-initialised Linear(hidden, 1) on the policy's detached final hidden
        states, replicated on every rank (outside FSDP; its grads are all-reduced by hand)."""
        if self.value_head is None:
            hidden = self.model.config.get_text_config().hidden_size
            head = torch.nn.Linear(hidden, 1, device=self.device)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            self.optim.add_param_group({"params": list(head.parameters())})
            self.value_head, self.critic_group = head, self.optim.param_groups[-1]
        return self.value_head

    def train_step(self, batch: dict[str, torch.Tensor], spec: TrainStep, num_tokens: int,
                   num_seqs: int) -> dict[str, Any]:
        """One optimizer step of `spec` on this rank's rows (`num_tokens`/`num_seqs`: the step's
        global counts); returns mergeable sums, counts and maxima. pi_prox is
        `batch["prox_logprobs"]`, the log-probs before the rollout batch's first optimizer step
        (`Policy.train`), or with one step per batch this forward's own, detached. A non-finite
        loss or grad norm on any rank skips the step on all (`nonfinite`)."""
        loss_fn, loss_args, loss_agg, temperature = (spec.loss_fn, spec.loss_args, spec.loss_agg,
                                                     spec.temperature)
        correction, correction_args, version, terms = (spec.correction, spec.correction_args,
                                                       spec.version, spec.terms)
        t0 = time.perf_counter()
        loss_total, sums, counts = 0.0, {}, {}
        max_abs = 0.0
        terms = terms or {}
        critic = self._critic() if "returns" in batch else None
        if critic is not None:
            self.critic_group["lr"] = terms.get("value_lr") or self.cfg["lr"]
        trained = []        # pre-update log-probs, for saved trajectories
        for mb in self._micro_batches(batch):
            mask = mb["loss_mask"]
            moe_out: dict[str, torch.Tensor] = {}
            extras: dict[str, torch.Tensor] = {}
            lp = self._logprobs(mb, temperature, moe_out, extras, critic)
            trained.append(F.pad(lp.detach(), (0, batch["input_ids"].shape[1] - lp.shape[1])))
            behavior = mb["behavior_logprobs"]
            # losses that name `group_index` / `ref_logprobs` get them (docs/plugins.md)
            kw = {**loss_args, **opt_in(loss_fn, group_index=mb.get("group_index"),
                                        ref_logprobs=None)}
            kl_loss = terms.get("kl_coef", 0.0) > 0 and terms.get("kl_in", "loss") == "loss"
            ref = None
            if kl_loss or "ref_logprobs" in kw:
                with torch.no_grad():
                    ref = self._logprobs(mb, temperature, model=self._reference())
                kw.update({k: ref for k in kw if k == "ref_logprobs"})
            prox = mb["prox_logprobs"] if "prox_logprobs" in mb else lp.detach()
            if correction == "none":
                per_token, metrics = loss_fn(lp, behavior, mb["advantages"], mask, **kw)
            else:
                per_token, metrics = loss_fn(lp, prox, mb["advantages"], mask, **kw)
                weight, is_metrics = is_correction(prox, behavior, mask, correction,
                                                   **(correction_args or {}))
                per_token = per_token * weight
                metrics = {**metrics, **is_metrics}
            add, term_metrics = loss_terms(
                lp, extras["entropy"], ref_logprobs=ref if kl_loss else None,
                values=extras.get("values"), old_values=mb.get("old_values"),
                returns=mb.get("returns"),
                **{k: v for k, v in terms.items() if k not in ("kl_in", "value_lr")})
            per_token, metrics = per_token + add, {**metrics, **term_metrics}
            loss = aggregate(per_token, mask, loss_agg, num_tokens, num_seqs)
            rows = float(mask.any(-1).sum())
            if moe_out and self.cfg["moe_aux_loss_coef"] > 0:
                # this micro-batch's share of the step's sequences: the sum is their mean
                loss = loss + self.cfg["moe_aux_loss_coef"] * moe_out["aux_loss"] * (
                    rows / max(num_seqs, 1))
            # FSDP2 averages grads over ranks; x grad_scale makes the step's grad sum/global count.
            (loss * self.grad_scale).backward()
            loss_total += float(loss.detach())
            with torch.no_grad():
                n_tok = float(mask.sum())
                diff = (prox - behavior)[mask]
                on_policy = mask if version is None else mask & (mb["versions"] == version)
                if on_policy.any():
                    max_abs = nanmax(max_abs, float(diff.abs()[on_policy[mask]].max()))
                k3 = float((diff.exp() - 1 - diff).sum())  # k3 estimate of KL(behavior || trainer)
                named = {"mismatch/kl": (k3, n_tok),
                         "mismatch/on_policy_fraction": (float(on_policy.sum()), n_tok)}
                rec = mb.get("routed_experts")
                if moe_out and rec is not None:
                    # Share of recorded (token, layer) routings the trainer's forward used as is:
                    # 1.0 under replay; with replay off, how often trainer and engine agree.
                    used = moe_out["ids"]
                    has = (rec >= 0).all(-1) & mb["attention_mask"][..., None]   # [b, T, L]
                    same = (used.sort(-1).values == rec.sort(-1).values.to(used)).all(-1)
                    named["moe/routing_agreement"] = (float((same & has).sum()),
                                                      float(has.sum()))
                if moe_out:
                    named["moe/aux_loss"] = (float(moe_out["aux_loss"]) * rows, rows)
                for k, v in metrics.items():
                    v = v.detach()
                    named[k] = ((float((v * mask).sum()), n_tok) if v.shape == mask.shape
                                else (float(v) * n_tok, n_tok))     # scalars: token-weighted
                for k, (s, c) in named.items():
                    sums[k] = sums.get(k, 0.0) + s
                    counts[k] = counts.get(k, 0.0) + c
        t1 = time.perf_counter()
        _reshard(self.model)              # before the grads and the optimizer: the shards
        grad_norm = self._clip_grads()
        if critic is not None:
            for p in critic.parameters():     # loss x world_size: SUM / world_size
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                dist.all_reduce(p.grad)
                p.grad /= self.world_size
            torch.nn.utils.clip_grad_norm_(critic.parameters(), self.cfg["grad_clip"])
        if self.reference is not None:
            _reshard(self.reference)
        finite = torch.tensor(float(math.isfinite(loss_total) and math.isfinite(grad_norm)),
                              device=self.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)      # every rank steps, or none does
        if finite.item():
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return {"loss": loss_total, "grad_norm": float(grad_norm), "sums": sums, "counts": counts,
                "max": {"mismatch/max_abs": max_abs, "memory/trainer_peak_gib": _peak_gib()},
                "nonfinite": not finite.item(),     # pi_prox given: the driver has them
                "logprobs": None if "prox_logprobs" in batch else torch.cat(trained).cpu().numpy(),
                "time": {"train/fwd_bwd_s": t1 - t0, "train/optim_s": time.perf_counter() - t1}}

    def _clip_grads(self) -> float:
        """Clip the step's gradients to `trainer.grad_clip`; returns their total norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["grad_clip"])
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                 with_routing: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[b, T] trainer log-probs of trainable tokens (0 elsewhere), pre-update weights;
        `with_routing` (MoE): also the [b, T, layers, k] expert ids the forward used (-1: pad)."""
        B, T = batch["input_ids"].shape
        out = torch.zeros(B, T)
        ids: torch.Tensor | None = None
        s = 0
        for mb in self._micro_batches(batch):
            moe_out: dict[str, torch.Tensor] = {}
            lp = self._logprobs(mb, temperature, moe_out).cpu()
            out[s:s + lp.shape[0], :lp.shape[1]] = lp
            if with_routing and moe_out:
                u = moe_out["ids"].cpu().to(torch.int32)
                if ids is None:
                    ids = torch.full((B, T, *u.shape[2:]), -1, dtype=torch.int32)
                ids[s:s + u.shape[0], :u.shape[1]] = u
            s += lp.shape[0]
        _reshard(self.model)
        return (out, ids) if with_routing else out

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[b, T] the critic's values of the states before trainable tokens (0 elsewhere)."""
        def fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
            extras: dict[str, torch.Tensor] = {}
            self._logprobs(mb, 1.0, None, extras, self._critic())
            return extras["values"]
        return self._per_token(batch, self.model, fn)

    @torch.no_grad()
    def ref_logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0
                     ) -> torch.Tensor:
        """[b, T] log-probs of trainable tokens under pi_ref (the frozen initial weights)."""
        ref = self._reference()
        return self._per_token(batch, ref, lambda mb: self._logprobs(mb, temperature, model=ref))

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
        """This rank's shards of model, optimizer and critic, and its RNG (`checkpoint`)."""
        ckpt.save_rank(self, path)
        return self.value_head is not None

    def load_checkpoint(self, path: str, critic: bool) -> None:
        ckpt.load_rank(self, path, critic)

    def _named_full_tensors(self, merge: bool = True, master: bool = False
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """Gathered parameters; with LoRA and `merge`, the merged HF weights (`lora.merged`); in
        the engines' dtypes (`model.dtype`, routers fp32) unless `master` (the fp32 masters)."""
        named = ((name, (p.full_tensor() if isinstance(p, DTensor) else p).detach())
                 for name, p in self.model.named_parameters())
        cfg = self.cfg["lora"]
        named = lora.merged(named, cfg["alpha"] / cfg["rank"]) if merge and cfg["rank"] else named
        dtype = _DTYPES[self.dtype]
        return ((n, t if master or n in self.fp32_names else t.to(dtype)) for n, t in named)

    def full_params(self, adapter: bool = False, master: bool = False) -> dict[str, torch.Tensor]:
        """Gathered parameters by HF name (LoRA: merged), or with `adapter` only the LoRA
        weights under PEFT's saved names (a collective: call on every rank); `master`: the fp32
        master weights instead of the engines' dtypes."""
        if adapter:
            return lora.adapter_tensors(self._named_full_tensors(merge=False, master=True))
        return {n: t.cpu() for n, t in self._named_full_tensors(master=master)}

    def push_weights(self, engines: list, version: int, bucket_bytes: int, timeout_s: float,
                     transport: str = "ray") -> dict[str, Any]:
        """Gather every parameter (all ranks); rank 0 sends dtype-preserving buckets to engines
        (`weight_sync.send`), over Ray or, with `transport="broadcast"`/`"shm"`, a process group
        / shared-memory channel built on the first push to these engines."""
        named = self._named_full_tensors()
        if self.rank != 0:
            for _ in named:             # each gather is a collective: take part, send nothing
                pass
            return {}
        try:
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
            for _ in named:             # finish the gathers: the other ranks stay in step
                pass
            raise


_IMAGE_KEYS = ("pixel_values", "image_grid_thw")   # per row, not per token (collate)


def _peak_gib() -> float:
    """This step's peak allocated GPU memory, or on CPU the rank's peak RSS so far (GiB)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return peak / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20    # KiB on Linux


def _reshard(model: Any) -> None:
    """Free gathered params: the root keeps its own after forward, on one rank every layer does
    through the step (`_build_model`)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _tensor(x: Any) -> torch.Tensor:
    return torch.tensor(x) if isinstance(x, np.ndarray) else x   # copied: Ray's is read-only


def nanmax(a: float, b: float) -> float:
    """max that keeps a NaN (Python's `max` drops it when it comes first)."""
    return a if math.isnan(a) else max(b, a)


def _images(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    return (mb["pixel_values"], mb["image_grid_thw"]) if "image_grid_thw" in mb else None

