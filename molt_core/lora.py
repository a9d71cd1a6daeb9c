"""LoRA (PEFT) on the policy: adapters injected into the HF model in place, so the trainer's
forward, FSDP2 sharding and chunked log-probs see the same module tree; only adapter weights
require grad (and get AdamW state). Engines receive merged weights under the plain HF names, or
with `trainer.lora.sync: adapter` only the adapters (`adapter_sync`), which they apply unmerged."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

__all__ = ["add_adapters", "adapter_sync", "adapter_tensors", "merged", "peft_config"]

Named = Iterator[tuple[str, torch.Tensor]]


def peft_config(lora: dict, base: str = "") -> Any:
    from peft import LoraConfig
    return LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=lora["target_modules"], base_model_name_or_path=base or None)


def add_adapters(model: torch.nn.Module, lora: dict) -> torch.nn.Module:
    """`trainer.lora` adapters injected into `model`; every other weight is frozen. The model is
    left in eval mode, the adapters' dropout off in every forward (the ratio's log-probs must be
    the merged weights' the engines sample): `lora.dropout` only reaches the exported config.
    `sync: adapter` keeps PEFT's forward, x W^T + s (x A^T) B^T, as the engines compute it."""
    from peft import inject_adapter_in_model
    model = inject_adapter_in_model(peft_config(lora | {"target_modules": _targets(
        model, lora["target_modules"])}), model).eval()
    if not any(".lora_A." in n for n, _ in model.named_parameters()):
        raise ValueError(f"trainer.lora.target_modules={lora['target_modules']!r} matched no "
                         "Linear of the model: use PEFT module names (q_proj, ...) or all-linear")
    from peft.tuners.lora.layer import Linear
    for m in model.modules():
        if type(m) is Linear:
            if lora.get("sync") != "adapter":
                m.forward = partial(_merged_forward, m)
            for p in (*m.lora_A.parameters(), *m.lora_B.parameters()):
                p.data = p.data.float()     # fp32 masters (PEFT made them in the base's dtype)
    return model


def _merged_forward(m: Any, x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    w, a, b, s = (m.base_layer.weight, m.lora_A["default"].weight, m.lora_B["default"].weight,
                  m.scaling["default"])
    kept = m.__dict__.get("molt_merged")       # `drop_merged(keep=True)` modules only
    if "molt_merged" in m.__dict__ and (kept is None or kept.dtype != x.dtype):
        with torch.no_grad():
            kept = m.molt_merged = _merge(w, a, b, s, x.dtype)
    return _Merged.apply(x, w, m.base_layer.bias, a, b, s, kept)


def drop_merged(model: torch.nn.Module, keep: bool = False) -> None:
    """Adapted layers that keep their merged weight drop it (the worker's `_reshard`, before
    every optimizer step); `keep`: from now on every adapted layer keeps it from the step's first
    forward: one merge a step, not one per forward and backward of each context (4 were ~8 % of a
    CPU SmolLM2 step)."""
    for m in model.modules():
        if "molt_merged" in m.__dict__ or (keep and hasattr(m, "lora_A")):
            m.molt_merged = None


class _Merged(torch.autograd.Function):
    """x (W + s B A)^T with the merged weight rounded to x's dtype, as the engines get it
    (`merged`): in bf16 the trainer computes the engines' function (adding B A x apart, it saw
    updates that the engines' rounding drops). Backward: A's and B's exact gradients through
    the merged weight, never W's [out, in] one; `kept`: the merged weight already made. (Molt
    never disables or merges PEFT's adapters: the KL reference is a model of its own.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, s: float, kept: torch.Tensor | None
                ) -> torch.Tensor:
        ctx.save_for_backward(x, w, a, b, kept)
        ctx.s = s
        return torch.nn.functional.linear(x, _merge(w, a, b, s, x.dtype) if kept is None
                                          else kept, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, w, a0, b0, kept = ctx.saved_tensors
        g2, x2 = g.flatten(0, -2), x.flatten(0, -2)
        a, b = a0.to(g.dtype), b0.to(g.dtype)      # fp32 masters where no FSDP2 casts them
        ga, gb = (g2 @ b).T @ x2 * ctx.s, g2.T @ (x2 @ a.T) * ctx.s
        gx = None                       # layer 0's x (the frozen embeddings') needs none
        if ctx.needs_input_grad[0]:
            gx = g @ (_merge(w, a, b, ctx.s, g.dtype) if kept is None else kept)
        return gx, None, None, ga.to(a0.dtype), gb.to(b0.dtype), None, None


def _merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, dtype: torch.dtype
           ) -> torch.Tensor:
    """W + s B A in `dtype`, rounded once (fp32 accumulation): the trainer's and engines' weight."""
    return torch.addmm(w.to(dtype), b.to(dtype), a.to(dtype), alpha=s)


def _targets(model: torch.nn.Module, targets: str | list) -> str | list:
    """all-linear as the names of the model's Linear layers but the output head: PEFT's own
    all-linear also adapts MoE routers and fused experts, which routing replay and `merged` need
    as they are (a MoE policy's experts stay frozen)."""
    if targets != "all-linear":
        return targets
    head = model.get_output_embeddings()
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def merged(named: Named, scaling: float) -> Named:
    """The (name, full tensor) stream of an adapted model as the plain HF model's: each adapted
    Linear `X` yields `X.weight` = W + scaling * B @ A (scaling = alpha / rank) once W, A and B
    have arrived."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        for tag, key in ((".base_layer.weight", "w"), (".lora_A.default.weight", "a"),
                         (".lora_B.default.weight", "b")):
            if name.endswith(tag):
                mod = name[:-len(tag)]
                p = parts.setdefault(mod, {})
                p[key] = t
                if len(p) == 3:
                    del parts[mod]
                    yield f"{mod}.weight", _merge(p["w"], p["a"], p["b"], scaling, p["w"].dtype)
                break
        else:
            yield name.replace(".base_layer.", "."), t
    if parts:
        raise RuntimeError(f"LoRA merge: incomplete adapted layers {sorted(parts)[:3]}")


def adapter_sync(named: Named, scaling: float) -> Named:
    """`sync: adapter`'s stream of an adapted model's LoRA parameters `named`: `X.lora_A.weight`
    [r, in] and `X.lora_B.weight` [out, r] per adapted Linear `X`, then `lora_scaling` (alpha /
    rank): the names `HFEngine` takes."""
    for name, t in named:
        yield name.replace(".default.", "."), t
    yield "lora_scaling", torch.tensor(float(scaling))


def adapter_tensors(named: Named) -> dict[str, torch.Tensor]:
    """Adapter weights under PEFT's saved names (`PeftModel.from_pretrained` loads them)."""
    return {f"base_model.model.{n.replace('.default.', '.')}": t.cpu() for n, t in named
            if ".lora_A." in n or ".lora_B." in n}

