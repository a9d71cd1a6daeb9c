"""Tiny local models: tokenizer, chat template, config/tokenizer agreement, determinism."""

from __future__ import annotations

import json
import string

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from molt_tools.tiny import SPECIAL_TOKENS, build_tiny_model

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "2 + 3"}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."},
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_letters_and_digits_are_single_tokens(tok):
    for ch in string.ascii_lowercase + string.digits:
        ids = tok.encode(ch, add_special_tokens=False)
        assert len(ids) == 1, (ch, ids)
        assert tok.decode(ids) == ch
    assert tok.encode("12345") == [tok.convert_tokens_to_ids(d) for d in "12345"]


def test_any_text_round_trips(tok):
    text = "What letter comes after c? d\nhéllo wörld 🙂 {\"x\": [1, 2]}\t~"
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_match_config(tok, tiny_model_dir):
    assert len(tok) == 512
    for t in SPECIAL_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids) == t
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    assert cfg.eos_token_id == tok.eos_token_id
    assert cfg.pad_token_id == gen.pad_token_id == tok.pad_token_id
    assert cfg.bos_token_id == gen.bos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id in gen.eos_token_id
    assert tok("a")["input_ids"] == [tok.convert_tokens_to_ids("a")]  # no bos/eos added


def test_chat_template(tok):
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nAnswer briefly.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "2 + 3"}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\nThe answer is 5.<|im_end|>\n")
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=False)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<tool_call>")) == 3  # twice in the tools prompt, once in the call
    # Generation prompt: the rendered history plus the assistant header is a prefix of the reply.
    for k in (2, 4):
        prompt = tok.apply_chat_template(CONVERSATION[:k], tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>assistant\n")
        assert tok.apply_chat_template(CONVERSATION[:k + 1], tools=TOOLS,
                                       tokenize=False).startswith(prompt)
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                    add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_loads_and_is_deterministic(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert next(model.parameters()).dtype == torch.float32
    assert (model.config.head_dim, model.config.vocab_size) == (32, 512)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 512)
    same = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "same", seed=0))
    other = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "other", seed=1))
    for (n, a), b, c in zip(model.named_parameters(), same.parameters(), other.parameters()):
        assert torch.equal(a, b), n
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert (tmp_path / "same" / "tokenizer.json").read_text() == \
        (tiny_model_dir / "tokenizer.json").read_text()


def test_moe_model(tmp_path):
    path = build_tiny_model(tmp_path / "moe", "qwen3_moe", extra_corpus=["zebra zebra zebra"])
    model = AutoModelForCausalLM.from_pretrained(path)
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (4, 2)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 512)
    assert len(AutoTokenizer.from_pretrained(path).encode(" zebra")) == 1  # extra corpus learned


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="valid: qwen3, qwen3_moe"):
        build_tiny_model(tmp_path / "x", "llama")
