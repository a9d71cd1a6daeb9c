"""Teach a tiny model fixed replies by a few steps of supervised fine-tuning.

Used by tests that need a *real* engine whose sampled tokens are, e.g., a well-formed tool call
(a random-init model almost never emits valid JSON), and to give CPU recipes a format prior.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

__all__ = ["imprint"]


def imprint(model_dir: str | Path, out_dir: str | Path, examples: list[tuple[str, str]], *,
            steps: int = 300, lr: float = 1e-2, tol: float | None = 0.01,
            batch_size: int | None = None, seed: int = 0) -> Path:
    """Fine-tune on (prompt_text, reply_text) pairs, loss on the reply only, for up to `steps`
    Adam steps on random mini-batches (all examples when `batch_size` is None). With `tol`, stop
    once the mean loss is below it and raise if it never is. Save model + tokenizer to `out_dir`."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    rows = []
    for prompt, reply in examples:
        p = tok(prompt, add_special_tokens=False).input_ids
        r = tok(reply, add_special_tokens=False).input_ids
        rows.append((torch.tensor([p + r]), torch.tensor([[-100] * len(p) + r])))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        batch = rows if batch_size is None else rng.sample(rows, min(batch_size, len(rows)))
        loss = sum(model(input_ids=x, labels=y).loss for x, y in batch) / len(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if tol is not None and loss.item() < tol:
            break
    else:
        if tol is not None:
            raise RuntimeError(f"imprint did not reach loss {tol}: {loss.item():.3g} after {steps} steps")
    out = Path(out_dir)
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        shutil.copy(gen, out / "generation_config.json")
    return out
