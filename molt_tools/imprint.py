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
            batch_size: int | None = None, clip: float | None = None, decay: bool = False,
            seed: int = 0, threads: int = 1) -> Path:
    """Fine-tune on (prompt_text, reply_text) pairs, loss on the reply only, for up to `steps`
    Adam steps on random mini-batches (all examples when `batch_size` is None), gradient norm
    clipped to `clip`, lr decayed linearly to 0 with `decay` (so that a reply's first token ends
    close to its frequency among the examples). With `tol`, stop once the mean loss is below it
    and raise if it never is. Save model + tokenizer to `out_dir`. `threads`: torch's, for the
    call (1 suits a tiny model: more only add overhead and spin on a busy box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _imprint(model_dir, out_dir, examples, steps, lr, tol, batch_size, clip, decay,
                        seed)
    finally:
        torch.set_num_threads(before)


def _imprint(model_dir: str | Path, out_dir: str | Path, examples: list[tuple[str, str]],
             steps: int, lr: float, tol: float | None, batch_size: int | None,
             clip: float | None, decay: bool, seed: int) -> Path:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    rows = []
    for prompt, reply in examples:
        p = tok(prompt, add_special_tokens=False).input_ids
        r = tok(reply, add_special_tokens=False).input_ids
        rows.append((p + r, [-100] * len(p) + r))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        if decay:
            opt.param_groups[0]["lr"] = lr * (1 - step / steps)
        batch = rows if batch_size is None else rng.sample(rows, min(batch_size, len(rows)))
        loss = _loss(model, batch, tok.pad_token_id or 0)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
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


def _loss(model: torch.nn.Module, batch: list[tuple[list[int], list[int]]], pad: int) -> torch.Tensor:
    """Mean reply-token loss over the batch (every token weighs the same, so a reply's first
    token is fitted to its frequency among the examples), in one right-padded forward."""
    n = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([x + [pad] * (n - len(x)) for x, _ in batch])
    labels = torch.tensor([y + [-100] * (n - len(y)) for _, y in batch])
    mask = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x, _ in batch])
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels[:, 1:],
                                             ignore_index=-100)
