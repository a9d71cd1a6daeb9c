"""The chat calculator recipe's policy: a tiny random-init Qwen3 with a short tools template,
imprinted (a short SFT) to call the calculator on a share of the questions and to guess otherwise.

`python -m molt_tools.calculator_model DIR` writes it (recipes/cpu/chat_calculator.yaml).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from molt_examples.calculator import TOOL

__all__ = ["build_model", "imprint_pairs", "short_tools_template"]


def short_tools_template(template: str) -> str:
    """`template` with the long Qwen tools preamble replaced by `Tools: name ...` (same Hermes
    `<tool_call>` format): a tiny model's prompt shrinks from ~170 to ~20 tokens."""
    head, rest = template.split("{%- if tools %}", 1)
    _, tail = rest.split("{%- elif messages[0].role == 'system' %}", 1)
    short = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}
{{- 'Tools:' }}{%- for tool in tools %}{{- ' ' + (tool.function or tool).name }}{%- endfor %}
{{- '<|im_end|>\\n' }}
"""
    return head + short + "{%- elif messages[0].role == 'system' %}" + tail


def imprint_pairs(tok: Any, lo: int, hi: int, tool_rate: float,
                  seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, reply) pairs: for every question, one correct calculator transcript (call, then
    the answer) per `1 / tool_rate - 1` direct answers that guess a random sum."""
    rng = random.Random(seed)
    call = '<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call><|im_end|>'
    pairs = []
    for a in range(lo, hi + 1):
        for b in range(lo, hi + 1):
            msgs: list[dict] = [{"role": "user", "content": f"What is {a} + {b}?"}]
            prompt = tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                             add_generation_prompt=True)
            for _ in range(round(1 / tool_rate) - 1):
                pairs.append((prompt, f"The answer is {rng.randint(2 * lo, 2 * hi)}.<|im_end|>"))
            args = json.dumps({"expression": f"{a} + {b}"})
            pairs.append((prompt, call.format(args=args)))
            msgs += [{"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c", "type": "function",
                          "function": {"name": "calculator", "arguments": args}}]},
                     {"role": "tool", "tool_call_id": "c", "content": str(a + b)}]
            pairs.append((tok.apply_chat_template(msgs, tools=[TOOL], tokenize=False,
                                                  add_generation_prompt=True),
                          f"The answer is {a + b}.<|im_end|>"))
    return pairs


def build_model(out_dir: str | Path, *, lo: int = 2, hi: int = 9, tool_rate: float = 0.2,
                steps: int = 400, batch_size: int = 32, lr: float = 1e-2,
                seed: int = 0) -> Path:
    """The recipe's policy in `out_dir`: a tiny random-init Qwen3 (short tools template) imprinted
    to call the calculator on a `tool_rate` share of the questions and to guess otherwise."""
    from transformers import AutoTokenizer

    from molt_tools.imprint import imprint
    from molt_tools.tiny import CHAT_TEMPLATE, build_tiny_model

    out = Path(out_dir)
    base = build_tiny_model(out / "base", vocab_size=1024, seed=seed,
                            extra_corpus=[
        "<|im_start|>system\nTools: calculator<|im_end|>\n",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
    ] * 50)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = short_tools_template(CHAT_TEMPLATE)
    tok.save_pretrained(base)
    imprint(base, out, imprint_pairs(tok, lo, hi, tool_rate, seed), steps=steps, lr=lr, tol=None,
            batch_size=batch_size, clip=1.0, decay=True, seed=seed)
    return out


if __name__ == "__main__":
    import sys
    print(build_model(sys.argv[1]))
