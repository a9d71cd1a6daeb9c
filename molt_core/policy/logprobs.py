"""Per-token log-probs of an HF causal LM at trainable positions: the one forward the trainer,
the reference policy and the consistency checks share (dense, MoE with routing replay, VL)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from molt_core import moe, multimodal

__all__ = ["token_logprobs"]


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   loss_mask: torch.Tensor, temperature: float, chunk: int,
                   routed_experts: torch.Tensor | None = None, moe_routing: str = "replay",
                   moe_out: dict | None = None,
                   images: tuple[torch.Tensor, torch.Tensor] | None = None,
                   extras: dict | None = None,
                   value_head: torch.nn.Module | None = None,
                   share_context: bool = False) -> torch.Tensor:
    """[b, T] log p(input_ids[:, t] | input_ids[:, <t]) / temperature at trainable t, 0 elsewhere.

    Only trainable positions go through `lm_head`, `chunk` tokens at a time; with grad enabled each
    chunk is recomputed in backward, so peak memory is [chunk, vocab] rather than [tokens, vocab].
    MoE models: `routed_experts` [b, T, layers, k] (-1 = none) is the engine's routing, replayed
    when `moe_routing` is "replay" (see `molt_core.moe.routing`); `moe_out` receives "ids", the
    [b, T, layers, k] expert ids the forward used, and "aux_loss", the load-balancing loss over
    the attended tokens of rows with a trainable token (`moe.routing(...).aux_loss`).
    VL models: `images` is the rows' (pixel_values [b, P, D], image_grid_thw [b, I, 3]) from
    `collate`, fed with the engine's mRoPE positions; vision tokens are masked as in the engine.
    `extras` (a dict) receives "entropy" [b, T], the entropy of the same temperature-scaled
    distribution at trainable t, and with `value_head` (the critic) "values" [b, T], the value of
    the state before token t, read from the detached final hidden state.
    `share_context`: a context rows share (a group's prompt) runs once; FSDP must keep the
    layers unsharded through backward then (`PolicyWorker` does on one rank).
    """
    extra = {}
    if images is not None and images[1].any():
        extra = multimodal.model_inputs(model, input_ids, attention_mask,
                                        *multimodal.unpack_rows(*images))
    with moe.routing(model, routed_experts, moe_routing) as routing:
        q, cache = _shared_context(model, input_ids, attention_mask, loss_mask,
                                   share_context and not (routing.used or extra))  # dense, text
        hidden = model.model(input_ids=input_ids[:, q:], attention_mask=attention_mask,
                             past_key_values=cache, use_cache=cache is not None,
                             **extra).last_hidden_state                       # [b, T - q, H]
    if moe_out is not None and routing.used:
        moe_out["ids"] = routing.ids().view(*input_ids.shape, *routing.ids().shape[1:])
        moe_out["aux_loss"] = routing.aux_loss(attention_mask.bool()
                                               & loss_mask.any(-1, keepdim=True))
    rows, cols = loss_mask[:, 1:].nonzero(as_tuple=True)    # hidden[:, t] predicts token t+1
    h, targets = hidden[rows, cols - q], input_ids[rows, cols + 1]               # [N, H], [N]
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=hidden.device)
    if extras is not None and value_head is not None:
        extras["values"] = out.index_put((rows, cols + 1),
                                         value_head(h.detach().float()).squeeze(-1))
    if rows.numel() == 0:
        if extras is not None:
            extras["entropy"] = out
        # Stay in the graph so backward, and with it FSDP's reduce-scatters, runs on every rank.
        return out + 0.0 * model.lm_head(hidden[:1, 0]).float().sum()

    banned = torch.tensor(multimodal.vision_token_ids(model.config), device=hidden.device,
                          dtype=torch.long)

    def piece(h_c: torch.Tensor, t_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model.lm_head(h_c).float() / temperature                       # [c, V]
        logits = logits.index_fill(-1, banned, -float("inf")) if banned.numel() else logits
        logp = logits.log_softmax(-1)
        # entropy: exp(-inf) * -inf is nan at banned ids; their probability is 0
        return (logp.gather(-1, t_c[:, None]).squeeze(-1),
                -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1))

    grad = torch.is_grad_enabled()
    pieces = [checkpoint(piece, h[s:s + chunk], targets[s:s + chunk], use_reentrant=False) if grad
              else piece(h[s:s + chunk], targets[s:s + chunk])
              for s in range(0, rows.numel(), chunk)]
    if extras is not None:
        extras["entropy"] = out.index_put((rows, cols + 1), torch.cat([p[1] for p in pieces]))
    return out.index_put((rows, cols + 1), torch.cat([p[0] for p in pieces]))


def _shared_context(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    loss_mask: torch.Tensor, share: bool) -> tuple[int, DynamicCache | None]:
    """(q, the KV cache of input_ids[:, :q] from one forward per distinct row, expanded to every
    row), q the last position before any trainable token; (0, None) if that saves < 1/4 of it."""
    B, T = input_ids.shape
    first = torch.where(loss_mask.any(-1), loss_mask.int().argmax(-1), attention_mask.sum(-1))
    q = int(first.min()) - 1                   # hidden[:, q] predicts the first trainable token
    if not share or q < 1 or not attention_mask[:, :q].all():
        return 0, None
    uniq, inv = torch.unique(input_ids[:, :q], dim=0, return_inverse=True)
    if (B - len(uniq)) * q * 4 < B * T:
        return 0, None
    cache = DynamicCache(config=model.config)
    model.model(input_ids=uniq, past_key_values=cache, use_cache=True)
    cache.batch_select_indices(inv)
    return q, cache
