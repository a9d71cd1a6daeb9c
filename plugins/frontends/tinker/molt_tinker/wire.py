"""Tinker's wire format <-> Molt's tensors: the SDK's protobuf forward/backward requests as rows of
a `collate`-shaped batch, Molt's log-probs and samples as the protobuf responses the SDK decodes
(`tinker.proto`, the schema the pinned SDK speaks). Bad input raises `UserError` naming it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

__all__ = ["Row", "UserError", "collate_rows", "decode_forward_backward", "forward_output",
           "rows_of", "sample_output"]

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class UserError(ValueError):
    """A bad request: the future fails with category "user" (the SDK's RequestFailedError)."""


@dataclass
class Row:
    """One Datum as a Molt row: ids = model_input + [last target] (position t's log-prob is of
    ids[t] given ids[:t], so target i sits at t = i + 1); per-target values [N]."""
    ids: list[int]
    weights: np.ndarray          # cross_entropy weights or RL advantages
    sampling_logprobs: np.ndarray | None


def _tensor(msg: pb.Tensor, name: str) -> np.ndarray:
    if msg.dtype not in _NUMPY:
        raise UserError(f"loss_fn_inputs['{name}']: dtype {msg.dtype} is not float32 or int64")
    dtype, shape = _NUMPY[msg.dtype], list(msg.shape)
    if msg.HasField("sparse_csr"):      # 2-D CSR (the SDK sparsifies 2-D target_tokens/weights)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, np.int64)
        out = np.zeros(shape, dtype)
        rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
        out[rows, col] = np.frombuffer(msg.sparse_csr.values, dtype)
        return out
    arr = np.frombuffer(msg.dense, dtype)
    return arr.reshape(shape) if shape else arr


def decode_forward_backward(msg: pb.ForwardBackwardRequest) -> tuple[dict, list[dict]]:
    """(loss_fn_config, datums {tokens, inputs}) of a ForwardBackwardRequest."""
    config = {k: v for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():          # v2 wins (strings only exist there)
        config[k] = v.text if v.WhichOneof("value") == "text" else v.number
    datums = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise UserError(f"datum {i}: only token chunks (EncodedTextChunk) are supported, "
                                f"not {chunk.WhichOneof('chunk')}")
            tokens += np.frombuffer(chunk.encoded_text.tokens, np.int32).tolist()
        datums.append({"tokens": tokens, "inputs": {k: _tensor(v, k)
                                                    for k, v in d.loss_fn_inputs.items()}})
    return config, datums


def rows_of(datums: list[dict], weight: str, sampled: bool, vocab: int) -> list[Row]:
    """Datums as rows; `weight`: the per-token weight input ("weights": optional, else ones;
    "advantages"), `sampled`: the sampler's "logprobs" needed. Each input must be [N] for a
    model_input of N tokens, targets the next inputs (Tinker's standard alignment)."""
    needs = (weight, "logprobs") if sampled else ()
    if not datums:
        raise UserError("no data: forward_backward needs at least one Datum")
    rows = []
    for i, d in enumerate(datums):
        x, inputs, n = d["tokens"], d["inputs"], len(d["tokens"])
        if n == 0:
            raise UserError(f"datum {i}: model_input has no tokens")
        for key in ("target_tokens", *needs):
            if key not in inputs:
                raise UserError(f"datum {i}: loss_fn_inputs lacks '{key}' (has "
                                f"{', '.join(sorted(inputs)) or 'nothing'})")
        for key, v in inputs.items():
            if v.shape != (n,):
                raise UserError(f"datum {i}: loss_fn_inputs['{key}'] has shape {list(v.shape)}; "
                                f"model_input has {n} tokens, so it must be [{n}]")
        y = inputs["target_tokens"].astype(np.int64)
        if (y < 0).any() or (y >= vocab).any():
            raise UserError(f"datum {i}: target_tokens outside the vocabulary [0, {vocab})")
        if x[1:] != y[:-1].tolist():
            k = next(j for j in range(n - 1) if x[j + 1] != y[j])
            raise UserError(f"datum {i}: target_tokens[{k}] = {y[k]} is not model_input[{k + 1}] "
                            f"= {x[k + 1]}; this server needs targets that continue the input "
                            "(target i = token i + 1 of the sequence)")
        rows.append(Row(x + [int(y[-1])], inputs.get(weight, np.ones(n)).astype(np.float32),
                        inputs["logprobs"].astype(np.float32) if sampled else None))
    return rows


def collate_rows(rows: list[Row], pad: int) -> dict[str, torch.Tensor]:
    """A `collate`-shaped batch [B, T]; every target trainable. `rollout_tokens` makes the step's
    sequence count 1 (each row 1/B of one sequence), so loss_agg seq-mean-token-sum is the plain
    sum over tokens and datums that Tinker's losses take."""
    B, T = len(rows), max(len(r.ids) for r in rows)
    out = {"input_ids": torch.full((B, T), pad, dtype=torch.long),
           "attention_mask": torch.zeros(B, T, dtype=torch.bool),
           "loss_mask": torch.zeros(B, T, dtype=torch.bool),
           "behavior_logprobs": torch.zeros(B, T), "advantages": torch.zeros(B, T),
           "versions": torch.full((B, T), -1, dtype=torch.long)}
    sampled = any(r.sampling_logprobs is not None for r in rows)
    for b, r in enumerate(rows):
        n = len(r.ids)
        out["input_ids"][b, :n] = torch.tensor(r.ids)
        out["attention_mask"][b, :n] = True
        out["loss_mask"][b, 1:n] = True
        out["advantages"][b, 1:n] = torch.from_numpy(r.weights)
        out["versions"][b, :n] = 0
        if r.sampling_logprobs is not None:
            out["behavior_logprobs"][b, 1:n] = torch.from_numpy(r.sampling_logprobs)
    if sampled:     # pi_old of the loss = the sampler's log-probs (Tinker's ratio p_theta / q)
        out["prox_logprobs"] = out["behavior_logprobs"].clone()
    out["rollout_tokens"] = out["loss_mask"].sum(-1, keepdim=True) * B
    return out


def _batched(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    flat = [np.ascontiguousarray(a, np.float32) for a in arrays]
    offsets = np.cumsum([0] + [a.nbytes for a in flat]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in flat), offsets=offsets.tobytes(),
                            dtype=pb.DTYPE_FLOAT32)


def forward_output(logprobs: list[np.ndarray], losses: list[np.ndarray],
                   metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput: per datum `logprobs` and `elementwise_loss` [N]; metrics keyed
    name:reduction (the SDK merges chunks by the suffix)."""
    record = pb.ArrayRecord(num_datums=len(logprobs))
    record.fields["logprobs"].CopyFrom(_batched(logprobs))
    record.fields["elementwise_loss"].CopyFrom(_batched(losses))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    out.loss_fn_outputs.append(record)
    return out.SerializeToString()


def sample_output(sequences: list[tuple[list[int], list[float], str]],
                  prompt_logprobs: list[float] | None) -> bytes:
    """SampleResponse: (tokens, logprobs, "stop" | "length") per sequence; prompt log-probs with
    NaN where none was computed (the first token)."""
    out = pb.SampleResponse()
    for tokens, lps, reason in sequences:
        out.sequences.add(tokens=np.asarray(tokens, np.int32).tobytes(),
                          logprobs=np.asarray(lps, np.float32).tobytes(),
                          stop_reason=pb.STOP_REASON_STOP if reason == "stop"
                          else pb.STOP_REASON_LENGTH)
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return out.SerializeToString()
