"""Tiny local models for tests and CPU recipes, saved as ordinary HF checkpoint directories.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here with `tokenizers` on a small
built-in corpus, the model is a randomly initialised Qwen3 (or Qwen3-MoE, or Qwen3-VL with a tiny
vision tower and its image processor) built from its config.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig,
                          PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig, Qwen3VLConfig)

__all__ = ["ARCHS", "CHARSET", "CHAT_TEMPLATE", "IMAGE_SIZE", "SPECIAL_TOKENS", "VISION_TOKENS",
           "build_char_tokenizer", "build_tiny_model", "build_tokenizer"]

ARCHS = ("qwen3", "qwen3_moe", "qwen3_vl")
CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 ?!.,:;+-*/=()"   # `--chars`: the toy alphabet
PAD, EOS = "<|endoftext|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, "<|im_start|>", EOS, "<tool_call>", "</tool_call>", "<think>", "</think>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_SIZE = 32     # qwen3_vl: images are resized to 32x32 (up to 64x64): 4x4 patches of 8 px

# Qwen2.5/Qwen3-style ChatML (no default system prompt, as in Qwen3; no thinking switch). Content
# may be a string or Qwen-VL style parts: text parts as their text, each image part (type "image"
# or "image_url") as <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = """\
{%- macro render(content) %}{%- if content is string %}{{- content }}{%- else %}
{%- for part in content %}{%- if part.type == 'image' or part.type == 'image_url' %}\
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif part.type == 'text' %}{{- part.text }}\
{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- render(messages[0].content) + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n\
{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + render(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + render(message.content or '') }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}\
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + render(message.content) + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_WORDS = """the a an and or not is are was be to of in on at for with from by it this that what
which who how many much letter letters word words number numbers comes after before next previous
answer question yes no true false add plus minus times divided equals sum total count spell
reverse first last one two three four five six seven eight nine ten zero hello world please
thank you user assistant system tool call result search calculator weather city name value
think step so therefore because if then else output input correct wrong good bad game move
left right up down start end stop go open close find get set make take give""".split()


def _corpus(extra: Sequence[str]) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = [" ".join(_WORDS), letters, " ".join(letters), letters.upper(), "0123456789"]
    lines += [f"What letter comes after {c}? {n}" for c, n in zip(letters, letters[1:])]
    lines += [f"What letter comes before {n}? {c}" for c, n in zip(letters, letters[1:])]
    lines += [f"{a} + {b} = {a + b}. {a} * {b} = {a * b}. {a + b} - {b} = {a}"
              for a in range(0, 20, 3) for b in range(1, 12, 2)]
    lines += [f"The answer is {i}." for i in range(10)]
    lines += ['{"name": "calculator", "arguments": {"expression": "2 + 3"}}',
              "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"]
    return lines + list(extra)


def build_tokenizer(vocab_size: int = 512, extra_corpus: Sequence[str] = (),
                    special: Sequence[str] = tuple(SPECIAL_TOKENS)) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every byte is in the base vocab, digits are split one per token (as Qwen).
    `special`: the special tokens, pad first (VL models add VISION_TOKENS)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(extra_corpus), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                 additional_special_tokens=list(special[1:]), model_max_length=512)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_char_tokenizer(charset: str, special: Sequence[str] = tuple(SPECIAL_TOKENS)
                         ) -> PreTrainedTokenizerFast:
    """One token per character of `charset` (plus the special tokens and <unk>): a tiny action
    space for toy recipes that a random-init policy must explore from scratch."""
    chars = list(dict.fromkeys(charset + "\n"))
    vocab = {t: i for i, t in enumerate([*special, "<unk>", *chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                 unk_token="<unk>", additional_special_tokens=list(special[1:]),
                                 model_max_length=2048)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_tiny_model(out_dir: str | Path, arch: str = "qwen3", *, hidden_size: int = 64,
                     num_layers: int = 2, seed: int = 0, vocab_size: int = 512,
                     extra_corpus: Sequence[str] = (), charset: str | None = None) -> Path:
    """Write a random-init fp32 model + tokenizer + generation_config to `out_dir`; return it.

    `charset` switches to a character-level tokenizer over those characters (vocab_size is then
    the tokenizer's size, and the context 2048 positions: a tools preamble alone is ~600 chars). `qwen3_vl` also writes the image processor (preprocessor_config.json)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny-model arch '{arch}'; valid: {', '.join(ARCHS)}")
    out = Path(out_dir)
    special = SPECIAL_TOKENS + (VISION_TOKENS if arch == "qwen3_vl" else [])
    tok = (build_char_tokenizer(charset, special) if charset
           else build_tokenizer(vocab_size, extra_corpus, special))
    vocab_size = len(tok) if charset else vocab_size
    if len(tok) > vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} tokens, more than vocab_size={vocab_size}")
    pad_id, eos_id = tok.convert_tokens_to_ids([PAD, EOS])
    # As in Qwen3 checkpoints: bos is <|endoftext|> in the config; nothing is prepended on encode.
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128,
                  num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, max_position_embeddings=2048 if charset else 512, tie_word_embeddings=True,
                  bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype="float32")
    if arch == "qwen3":
        config = Qwen3Config(**common)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True)
    else:
        config = _vl_config(common, tok)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if arch == "qwen3_vl" else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id],
                                               pad_token_id=pad_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if arch == "qwen3_vl":
        _image_processor().save_pretrained(out)
    return out


def _vl_config(text: dict, tok: PreTrainedTokenizerFast) -> Qwen3VLConfig:
    """Qwen3-VL: the text model as above with mRoPE (sections sum to head_dim / 2, interleaved as
    in Qwen3-VL checkpoints); a 2-block vision tower (patch 8, 2x2 merge: a 32x32 image is 4x4
    patches, 4 placeholder tokens) with one deepstack layer."""
    vision_start, vision_end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    text = {**text, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                        "mrope_section": [6, 5, 5], "mrope_interleaved": True}}
    text.pop("tie_word_embeddings")
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=(IMAGE_SIZE // 8) ** 2, deepstack_visual_indexes=[0])
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=image,
                         video_token_id=video, vision_start_token_id=vision_start,
                         vision_end_token_id=vision_end, tie_word_embeddings=True)


def _image_processor() -> Any:
    """Qwen2-VL image processor (the one Qwen3-VL uses), PIL backend: no torchvision needed."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE ** 2, "longest_edge": (2 * IMAGE_SIZE) ** 2},
        patch_size=8, temporal_patch_size=2, merge_size=2)


def add_args(p: Any) -> None:
    """`molt tiny-model` options."""
    p.add_argument("out_dir")
    p.add_argument("--arch", default="qwen3", choices=list(ARCHS),
                   help="qwen3_vl: with a tiny vision tower and its image processor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chars", nargs="?", const="basic", choices=["basic", "tools"],
                   help="character-level tokenizer (a ~50-token action space for toy recipes;"
                        " 'tools': with capitals and the JSON characters tool calls need)")


def main(args: Any) -> int:
    # Appended, so the ids of CHARSET stay; a separate choice, since a bigger vocab would change
    # the toy recipes' random init and action space.
    tools = CHARSET + '{}"[]_<>\'#' + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    print(build_tiny_model(args.out_dir, arch=args.arch, seed=args.seed,
                           charset={"basic": CHARSET, "tools": tools}.get(args.chars)))
    return 0
