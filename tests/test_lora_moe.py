"""LoRA on a MoE policy: `all-linear` adapts the Linear layers only, so the routers stay the
gates routing replay records and replays, and the merged stream the engines receive carries the
plain model's names (PEFT's own all-linear also wraps the router and the fused experts)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from molt_core.lora import add_adapters, merged
from molt_core.moe import moe_gates
from molt_tools.tiny import build_tiny_model

LORA = dict(rank=4, alpha=8, dropout=0.0, target_modules="all-linear")


def test_all_linear_on_moe_keeps_routers_and_plain_names(tmp_path) -> None:
    path = build_tiny_model(tmp_path / "moe", "qwen3_moe")
    base = AutoModelForCausalLM.from_pretrained(path)
    plain = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = add_adapters(base, LORA)
    assert len(moe_gates(model)) == 2
    adapted = {n.split(".lora_A.")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted and all(n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")
                           for n in adapted)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_" in n for n in trainable)
    out = dict(merged(model.named_parameters(), scaling=2.0))
    assert out.keys() == plain.keys()
    for n, t in out.items():    # lora_B starts at zero: merged == the base weights
        torch.testing.assert_close(t, plain[n])
