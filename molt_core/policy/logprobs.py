"""Per-token log-probs of an HF causal LM at trainable positions: the one forward the trainer,
the reference policy and the consistency checks share (dense, MoE with routing replay, VL)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from molt_core import moe, multimodal

__all__ = ["Forward", "token_logprobs"]


class Forward(NamedTuple):
    """What `token_logprobs` computes (a NamedTuple: FSDP2's forward hooks see its tensors)."""
    logprobs: torch.Tensor                  # [b, T]
    entropy: torch.Tensor                   # [b, T]
    values: torch.Tensor | None = None      # [b, T], with a value head
    expert_ids: torch.Tensor | None = None  # [b, T, layers, k], MoE
    aux_loss: torch.Tensor | None = None    # [], MoE


def token_logprobs(model: Any, batch: dict[str, torch.Tensor], temperature: float, chunk: int,
                   *, moe_routing: str = "replay", value_head: torch.nn.Module | None = None,
                   share_context: bool = False) -> Forward:
    """`logprobs` [b, T]: log p(input_ids[:, t] | input_ids[:, <t]) / temperature at trainable t
    (`loss_mask`), 0 elsewhere, of a `collate` batch (input_ids, attention_mask, loss_mask, ...).

    Only trainable positions go through `lm_head`, `chunk` tokens at a time, recomputed in backward
    (`_Head`): peak memory [chunk, vocab], not [tokens, vocab].
    `entropy` [b, T]: of the same temperature-scaled distribution at trainable t; `values` [b, T]
    with `value_head` (the critic): of the state before token t, from the detached hidden state.
    MoE models: `batch["routed_experts"]` [b, T, layers, k] (-1 = none), when present, is the
    engine's routing, replayed when `moe_routing` is "replay" (see `molt_core.moe.routing`);
    `expert_ids` [b, T, layers, k] are the ids the forward used, `aux_loss` the load-balancing
    loss over the attended tokens of rows with a trainable token (`moe.routing(...).aux_loss`).
    VL models: the rows' `pixel_values` [b, P, D] and `image_grid_thw` [b, I, 3] from `collate`
    are fed with the engine's mRoPE positions; vision tokens are masked as in the engine.
    `share_context`: a context rows share (a group's prompt, a system prompt) runs once; FSDP
    must keep the layers unsharded through backward then (`PolicyWorker` does on one rank)."""
    input_ids, attention_mask, loss_mask = (batch["input_ids"], batch["attention_mask"],
                                            batch["loss_mask"])
    extra = {}
    if "image_grid_thw" in batch and batch["image_grid_thw"].any():
        extra = multimodal.model_inputs(model, input_ids, attention_mask, *multimodal.unpack_rows(
            batch["pixel_values"], batch["image_grid_thw"]))
    with moe.routing(model, batch.get("routed_experts"), moe_routing) as routing:
        T = input_ids.shape[1]
        end = T - (T > 1 and not (routing.used or extra))     # text: the last predicts none
        q, hidden = _trunk(model, input_ids[:, :end], attention_mask[:, :end], loss_mask, extra,
                           share_context and not (routing.used or extra))   # [b, end - q, H]
    ids = aux = None
    if routing.used:
        ids = routing.ids().view(*input_ids.shape, *routing.ids().shape[1:])
        aux = routing.aux_loss(attention_mask.bool() & loss_mask.any(-1, keepdim=True))
    rows, cols = loss_mask[:, 1:].nonzero(as_tuple=True)    # hidden[:, t] predicts token t+1
    h, targets = hidden[rows, cols - q], input_ids[rows, cols + 1]               # [N, H], [N]
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=hidden.device)
    values = None if value_head is None else out.index_put(
        (rows, cols + 1), value_head(h.detach().float()).squeeze(-1))
    banned = h.new_tensor(multimodal.vision_token_ids(model.config), dtype=torch.long)
    # `chunk` rows at a time; with none, one empty chunk keeps backward (FSDP's reduce-scatters)
    logp, entropy = (torch.cat(x) for x in zip(*(
        _Head.apply(h[s:s + chunk], targets[s:s + chunk], model.lm_head, banned, temperature)
        for s in range(0, max(len(h), 1), chunk))))
    return Forward(out.index_put((rows, cols + 1), logp), out.index_put((rows, cols + 1), entropy),
                   values, ids, aux)


class _Head(torch.autograd.Function):
    """([n] log-probs of `targets`, [n] entropies) of p = softmax(z), z = head(h) / T, banned ids
    masked. d logp_t / dz = onehot_t - p, dH / dz = -p (logp + H). A frozen head (LoRA) makes
    d logp_t / dh = (onehot_t - p) W / T in forward, [n, H]; else backward recomputes the [n, V]
    logits (peak memory: one chunk's) and sends the closed form through `head`."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                banned: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)             # an unused output's grad stays None
        ctx.head, ctx.temperature, ctx.dh = head, temperature, None
        with torch.no_grad():
            logp = _log_softmax(head(h), banned, temperature)
            p = logp.exp()
            entropy = -(p[:, None] @ logp[..., None]).view(-1)   # no [n, V] product written
            if ctx.needs_input_grad[0] and not head.weight.requires_grad:
                p.neg_()[torch.arange(len(p)), targets] += 1
                ctx.dh = p.to(h.dtype) @ head.weight.to(h.dtype) / temperature
        ctx.save_for_backward(h, targets, banned, entropy)
        return logp.gather(-1, targets[:, None]).squeeze(-1), entropy

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, None, None, None, None]:
        if ctx.dh is not None and g_logp is not None and g_entropy is None:
            return g_logp[:, None].to(ctx.dh.dtype) * ctx.dh, None, None, None, None
        h, targets, banned, entropy = ctx.saved_tensors
        h = h.detach().requires_grad_()
        with torch.enable_grad():
            logits = ctx.head(h)
        with torch.no_grad():
            logp = _log_softmax(logits, banned, ctx.temperature)
            g_lp = torch.zeros_like(entropy) if g_logp is None else g_logp
            coef = -g_lp[:, None] if g_entropy is None else (
                -g_lp[:, None] - g_entropy[:, None] * (logp + entropy[:, None]))
            g = logp.exp_().mul_(coef).scatter_add_(-1, targets[:, None], g_lp[:, None])
            g = (g / ctx.temperature if ctx.temperature != 1 else g).to(logits.dtype)
        torch.autograd.backward(logits, g)          # lm_head's weight grads, if it trains
        return h.grad, None, None, None, None


def _grouped_eager(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float,
                   molt_pack: tuple | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """HF's eager attention (no dropout) with each KV head's G query heads as G x T rows of one
    matmul instead of K and V copied G times (`repeat_kv`): those copies and their backward sums
    were ~5 % of a CPU SmolLM2 step. `molt_pack` (u, q, sel): `_trunk`'s packed forward, u
    prompts of q tokens then B rows of t, row r continuing prompt sel[r] (one-hot [B, u]): each
    prompt causal, each row over its prompt's keys and its own, as with a KV cache."""
    if molt_pack is not None:
        (u, q, sel), n = molt_pack, molt_pack[0] * molt_pack[1]
        B, t = len(sel), (query.shape[2] - n) // len(sel)

        def part(x: torch.Tensor, b: int) -> torch.Tensor:    # [1, h, b t, d] -> [b, h, t, d]
            return x[0].unflatten(1, (b, -1)).transpose(0, 1)
        mask = query.new_full((q + t, q + t), torch.finfo(query.dtype).min).triu(1)[None, None]
        kp, vp = part(key[:, :, :n], u), part(value[:, :, :n], u)
        k, v = (torch.cat([_expand(sel, x), part(y[:, :, n:], B)], 2)
                for x, y in ((kp, key), (vp, value)))
        return torch.cat([
            _grouped_eager(module, part(query[:, :, :n], u), kp, vp, mask[..., :q, :q],
                           scaling)[0].flatten(0, 1),
            _grouped_eager(module, part(query[:, :, n:], B), k, v, mask[..., q:, :], scaling
                           )[0].flatten(0, 1)])[None], None
    (b, h, t, d), kv = query.shape, key.shape[1]
    w = query.reshape(b, kv, h // kv * t, d) @ key.transpose(2, 3) * scaling
    if attention_mask is not None:
        w = (w.view(b, kv, h // kv, t, -1) + attention_mask[:, :, None, :, :key.shape[2]]
             ).flatten(2, 3)
    w = w.softmax(-1, dtype=torch.float32).to(query.dtype)
    return (w @ value).view(b, h, t, d).transpose(1, 2).contiguous(), None


AttentionInterface.register("molt_eager", _grouped_eager)
AttentionMaskInterface.register("molt_eager", eager_mask)


def fast_norms(model: torch.nn.Module) -> None:
    """HF's RMSNorm forwards (Llama, Qwen: w * (x / rms(x) in fp32).to(x.dtype)) as one autograd
    node: the same output bit for bit, half the time forward and backward (8 + 12 small ops were
    ~8 % of a CPU SmolLM2 step)."""
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            m.forward = lambda x, m=m: _RMSNorm.apply(x, m.weight, m.variance_epsilon)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        r = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        n = (xf * r).to(x.dtype)
        ctx.save_for_backward(n, r, w)
        return w * n

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        n, r, w = ctx.saved_tensors
        gn, nf = (g * w).float(), n.float()
        gw = (g * n).flatten(0, -2).sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        return (gn - nf * (gn * nf).mean(-1, keepdim=True)).mul_(r).to(g.dtype), gw, None


def _log_softmax(logits: torch.Tensor, banned: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float() / temperature if temperature != 1 else logits.float()
    # banned ids at -1e30, not -inf: p = 0 exactly, p * logp and its grads stay finite
    return (z.index_fill(-1, banned, -1e30) if banned.numel() else z).log_softmax(-1)


def _trunk(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
           loss_mask: torch.Tensor, extra: dict, share: bool) -> tuple[int, torch.Tensor]:
    """(q, the last hidden states [b, t - q, H] of input_ids [b, t] from q on). `share`: the
    context before q (the last position before any trainable token) runs once per distinct row,
    or the prefix all rows have once if that saves more (an SFT batch's system prompt), if it
    saves >= 1/4 of the tokens: with `molt_eager` packed with the right-padded rows into one
    forward (`molt_pack`), else as a KV cache expanded to the rows. Else q = 0: the rows as is."""
    B, T = input_ids.shape
    first = torch.where(loss_mask.any(-1), loss_mask.int().argmax(-1), attention_mask.sum(-1))
    q = int(first.min()) - 1                   # hidden[:, q] predicts the first trainable token
    if share := share and q >= 1 and bool(attention_mask[:, :q].all()):
        uniq, inv = torch.unique(input_ids[:, :q], dim=0, return_inverse=True)
        p = int((input_ids[:, :q] == input_ids[:1, :q]).all(0).cumprod(0).sum())   # all rows'
        if (B - len(uniq)) * q < (B - 1) * p:
            uniq, inv, q = input_ids[:1, :p], inv.zero_(), p
    if not share or (B - len(uniq)) * q * 4 < B * T:
        return 0, model.model(input_ids=input_ids, attention_mask=attention_mask,
                              **extra).last_hidden_state
    sel = torch.nn.functional.one_hot(inv, len(uniq))   # [B, u]: its matmul's backward sums
    if model.config._attn_implementation == "molt_eager" and (
            attention_mask[:, :-1] >= attention_mask[:, 1:]).all():
        ids = torch.cat([uniq.flatten(), input_ids[:, q:].flatten()])[None]
        pos = torch.cat([torch.arange(q).repeat(len(uniq)), torch.arange(q, T).repeat(B)])
        h = model.model(input_ids=ids, position_ids=pos[None].to(ids.device),
                        molt_pack=(len(uniq), q, sel)).last_hidden_state
        return q, h[0, len(uniq) * q:].view(B, T - q, -1)
    cache = DynamicCache(config=model.config)
    model.model(input_ids=uniq, past_key_values=cache, use_cache=True)
    for c in cache.layers:
        c.keys, c.values = _expand(sel, c.keys), _expand(sel, c.values)
    return q, model.model(input_ids=input_ids[:, q:], attention_mask=attention_mask,
                          past_key_values=cache, use_cache=True).last_hidden_state


def _expand(sel: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[u, ...] K or V -> [B, ...] by the one-hot sel [B, u]: a matmul (backward 4x faster)."""
    return (sel.to(x.dtype) @ x.reshape(len(x), -1)).view(len(sel), *x.shape[1:])
