"""`token_logprobs(share_context=True)` runs the prefix all rows of a batch have (an SFT batch's
system prompt and chat header) once and the rows from there (`logprobs._trunk`): the log-probs,
entropies and gradients are the rows' own forward's, and rows sharing no prefix run as they are."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from molt_core import lora
from molt_core.policy.logprobs import token_logprobs

PREFIX, LENGTHS = 20, (40, 33, 37, 29)        # rows of different lengths, right-padded


def rows(shared: int) -> dict[str, torch.Tensor]:
    """Four rows, the first `shared` tokens the same in all; each trains on its last tokens,
    from different positions."""
    g = torch.Generator().manual_seed(0)
    T = max(LENGTHS)
    ids = torch.randint(3, 200, (len(LENGTHS), T), generator=g)
    ids[:, :shared] = torch.randint(3, 200, (shared,), generator=g)
    attn, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    for r, n in enumerate(LENGTHS):
        attn[r, :n], loss[r, n - 8 + r:n] = 1, 1
        ids[r, n:] = 0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}


def model(path, adapters: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    if adapters:                    # B random, not 0: A gets a gradient
        m = lora.add_adapters(m, {"rank": 4, "alpha": 8, "dropout": 0.0,
                                  "target_modules": "all-linear"})
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.data = torch.randn_like(p) * 0.1
    return m


@pytest.mark.parametrize("attn", ["sdpa", "molt_eager"])
@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_the_shared_prefix_runs_once_with_the_rows_own_results(tiny_model_dir, attn, adapters):
    batch, out, calls = rows(PREFIX), [], []
    for share in (False, True):
        m = model(tiny_model_dir, adapters)
        m.config._attn_implementation = attn
        m.model.register_forward_pre_hook(
            lambda mod, a, k: calls.append(tuple(k["input_ids"].shape)), with_kwargs=True)
        fwd = token_logprobs(m, batch, 0.7, 16, share_context=share)
        (fwd.logprobs.sum() + fwd.entropy.sum()).backward()
        out.append((fwd.logprobs, fwd.entropy, *(p.grad for p in m.parameters()
                                                 if p.requires_grad)))
    T = max(LENGTHS) - 1                    # the last position predicts nothing
    want = [(4, T), (1, PREFIX + 4 * (T - PREFIX))] if attn == "molt_eager" else [
        (4, T), (1, PREFIX), (4, T - PREFIX)]
    assert calls == want                    # the prefix once, then the rows from it
    assert (out[0][0] != 0).sum() == 8 * 4 - 6 and len(out[0]) > 10
    for got, ref in zip(out[1], out[0]):    # fp64, but HF's RMSNorms compute in fp32: the
        assert got is not None and ref.abs().max() > 0      # prefix's sum of 4 rows' gradients
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # rounds apart at ~1e-7


def test_rows_sharing_no_prefix_run_as_they_are(tiny_model_dir):
    batch, calls = rows(0), []
    batch["input_ids"][1, 0] = batch["input_ids"][0, 0] + 1       # no common first token
    m = model(tiny_model_dir, adapters=False)
    m.model.register_forward_pre_hook(
        lambda mod, a, k: calls.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    token_logprobs(m, batch, 1.0, 16, share_context=True)
    assert calls == [(4, max(LENGTHS) - 1)]
