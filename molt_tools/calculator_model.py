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

__all__ = ["build_model", "imprint_pairs", "scripted_demos", "sft_model", "short_tools_template"]


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


def scripted_demos(recipe: str | Path, out: str | Path, n: int, *args: str) -> list[dict]:
    """`molt rollout RECIPE -n N --policy scripted --keep 'reward>=1' --sft-out OUT ARGS` (the
    agent's oracle, ChatAgent.policy): the kept episodes as chat rows for `sft_model`."""
    from molt_tools.commands import main

    out = Path(out)
    if main(["rollout", str(recipe), "-n", str(n), "--policy", "scripted", "--keep", "reward>=1",
             "--sft-out", str(out), "--quiet", f"out_dir={out.parent / 'rollouts'}", *args]):
        raise RuntimeError(f"molt rollout {recipe} --policy scripted failed")
    return [json.loads(line) for line in out.read_text().splitlines()]


def sft_model(model_dir: str | Path, out_dir: str | Path, rows: list[dict], *, steps: int = 300,
              lr: float = 1e-2, batch_size: int = 0, tol: float | None = 0.01,
              schedule: str = "constant", seed: int = 0) -> Path:
    """`molt sft` (molt_core.sft, full fine-tuning, embedded: no Ray) of `model_dir` on chat
    `rows` ({"messages": [...], "tools": [...]}, as `molt rollout --sft-out` writes), `steps`
    steps of `batch_size` rows (0: all) at `lr` (`schedule`: trainer.lr_schedule); the model is
    `out_dir/run/final`, returned. With `tol`, raise if the last step's loss is not below it (a
    test's model must have learned its replies)."""
    from molt_core.cli import load
    from molt_core.sft_trainer import sft

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, plugins = load(None, [
        f"model.path={model_dir}", f"seed={seed}", f"sft.data={data}", f"sft.steps={steps}",
        f"sft.batch_size={batch_size or len(rows)}", "sft.eval_fraction=0", f"trainer.lr={lr}",
        f"trainer.lr_schedule={schedule}", "trainer.lora.rank=0", "trainer.save_every=0",
        "agent.args={env: addition}",            # not used: molt sft runs no agent
        "ray.embedded=on", "ray.num_cpus=1",     # in the driver (no Ray), one thread: a tiny model
        f"trainer.micro_batch_size={batch_size or len(rows)}", "log.sinks=[]"])
    (out / "run").mkdir(exist_ok=True)
    history = sft(cfg, plugins, out / "run", progress=False)
    loss = [h["train/loss"] for h in history if "train/loss" in h][-1]
    if tol is not None and loss >= tol:
        raise RuntimeError(f"molt sft did not reach loss {tol}: {loss:.3g} after {steps} steps")
    return out / "run" / "final"


if __name__ == "__main__":
    import sys
    print(build_model(sys.argv[1]))
