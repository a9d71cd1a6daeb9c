"""The converted SmolLM2-135M-Instruct equals transformers' own GGUF load (issue 13)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt_tools.pretrained import load_gguf

NAME = "smollm2-135m-instruct"


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_converted_model_matches_gguf_load(smollm2_dir: Path) -> None:
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert cfg["pad_token_id"] == tok.pad_token_id != tok.eos_token_id
    messages = [{"role": "system", "content": "Answer with just the final number."},
                {"role": "user", "content": "Tom has 17 apples and buys 25 more. How many now?"},
                {"role": "assistant", "content": "42"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    gguf_model, gguf_tok = load_gguf(NAME)
    assert tok.chat_template == gguf_tok.chat_template
    ids = torch.tensor([tok(text).input_ids])
    assert ids[0].tolist() == gguf_tok(text).input_ids
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert getattr(model, "hf_quantizer", None) is None
    diff = (_logprobs(model, ids) - _logprobs(gguf_model, ids)).abs().max().item()
    assert diff <= 1e-4, diff
    # a trained model, not noise: far better than uniform over the 49K vocabulary (-10.8)
    assert _logprobs(model, ids).mean() > -4.0
