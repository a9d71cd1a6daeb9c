"""Mixture-of-experts routing: record it in the engine, replay it in the trainer (R3). What a MoE
block is here and how `routing` patches its gate: docs/scaling.md, "MoE policies"."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["MOE_ROUTING", "config_moe_layers", "keep_router_fp32", "moe_gates", "routing"]

MOE_ROUTING = ("replay", "off", "freeze_router")


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of the model's MoE blocks, in layer order (empty for dense models)."""
    gates = []
    for m in model.modules():
        gate = m._modules.get("gate")      # not getattr: ~2,500 misses were 5 ms a forward
        if (gate is not None and hasattr(m, "experts")
                and hasattr(gate, "top_k") and hasattr(gate, "weight")):
            gates.append(gate)
    return gates


def config_moe_layers(config: Any) -> list[int]:
    """Indices of the decoder layers with a MoE block, from an HF config alone (Qwen2/3-MoE rule:
    every `decoder_sparse_step`-th layer not in `mlp_only_layers`); [] for dense models."""
    c = config.get_text_config()
    if not (getattr(c, "num_experts", 0) or getattr(c, "num_local_experts", 0)):
        return []
    step = getattr(c, "decoder_sparse_step", 1) or 1
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    return [i for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def keep_router_fp32(model: torch.nn.Module) -> None:
    """Router weights stay fp32 whatever the model dtype (their small logit differences decide
    the top-k; bf16 flips choices and loses small updates)."""
    for gate in moe_gates(model):
        gate.float()


class _Routing:
    def __init__(self, n_layers: int) -> None:
        self.used: list[torch.Tensor | None] = [None] * n_layers
        self.probs: list[torch.Tensor | None] = [None] * n_layers     # [N, E] fp32 per layer

    def ids(self) -> torch.Tensor:
        """[N, L, k] expert ids the last forward used (N = its flattened positions)."""
        return torch.stack(self.used, dim=1)

    def aux_loss(self, mask: torch.Tensor) -> torch.Tensor:
        """Load-balancing loss over positions where `mask` [N] holds, averaged over layers:
        E * sum_e f_e * P_e, f_e = share of top-k slots routed to expert e (the ids used, so
        replayed ones under replay), P_e = mean router probability of e (Switch Transformer eq.
        4-6; the value of transformers' `load_balancing_loss_func` when nothing is replayed)."""
        m = mask.reshape(-1).to(self.probs[0].device, torch.float32)
        E = self.probs[0].shape[-1]
        f, p = torch.zeros(E, device=m.device), torch.zeros(E, device=m.device)
        for probs, idx in zip(self.probs, self.used):
            f = f.scatter_add(0, idx.reshape(-1), m.repeat_interleave(idx.shape[-1]))
            p = p + (probs * m[:, None]).sum(0)
        rows = m.sum().clamp(min=1) * len(self.probs)
        return E * ((f / rows) * (p / rows)).sum()


@contextlib.contextmanager
def routing(model: torch.nn.Module, replay: torch.Tensor | None = None,
            mode: str = "replay") -> Iterator[_Routing]:
    """Run the MoE gates in fp32, replaying `replay` ids ([b, T, L, k], -1 = route normally)
    when `mode` is "replay"; "freeze_router" also cuts the router's gradient. See module doc."""
    if mode not in MOE_ROUTING:
        raise ValueError(f"moe routing mode '{mode}' unknown; valid: {', '.join(MOE_ROUTING)}")
    gates = moe_gates(model)
    state = _Routing(len(gates))
    if replay is not None and replay.shape[2] != len(gates):
        raise ValueError(f"recorded routing has {replay.shape[2]} MoE layers, the trainer's model "
                         f"has {len(gates)}: engine and trainer models differ")
    for layer, gate in enumerate(gates):
        ids = replay[:, :, layer].reshape(-1, replay.shape[-1]) if (
            replay is not None and mode == "replay") else None
        gate.forward = _gate_forward(gate, ids, state, layer, mode == "freeze_router")
    try:
        yield state
    finally:
        for gate in gates:
            del gate.forward        # back to the class's forward


def _gate_forward(gate: torch.nn.Module, replay: torch.Tensor | None, state: _Routing,
                  layer: int, frozen: bool):
    def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = hidden.reshape(-1, gate.weight.shape[-1])
        weight = gate.weight.detach() if frozen else gate.weight
        logits = F.linear(hidden.float(), weight.float())                       # [N, E] fp32
        probs = logits.softmax(-1)
        idx = torch.topk(probs, gate.top_k, dim=-1).indices                     # [N, k]
        if replay is not None:
            ids = replay.to(idx.device, torch.long)
            if ids.shape[0] != idx.shape[0]:
                raise ValueError(f"recorded routing covers {ids.shape[0]} positions, the forward "
                                 f"has {idx.shape[0]}")
            idx = torch.where(ids >= 0, ids, idx)
        top = probs.gather(-1, idx)
        if getattr(gate, "norm_topk_prob", True):
            top = top / top.sum(-1, keepdim=True)
        state.used[layer], state.probs[layer] = idx.detach(), probs
        return logits.to(hidden.dtype), top.to(hidden.dtype), idx
    return forward
