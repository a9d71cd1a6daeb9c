"""The rules a `Config` must pass: contradictions and impossible values, each a `ConfigError` that
names the key and the fix, raised before any process starts (`load_config` applies them)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from molt_core.config import Config, SamplingConfig

__all__ = ["ConfigError", "model_facts", "type_ok", "validate"]


class ConfigError(ValueError):
    """A configuration problem, reported before anything starts."""


def type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in typing.get_args(tp))
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    try:
        return isinstance(value, origin or tp)
    except TypeError:               # an annotation isinstance cannot check (TypeVar, ...)
        return True




def _require(rules: list[tuple[Any, str]]) -> None:
    """Raise the message of the first rule whose condition is false."""
    for ok, msg in rules:
        if not ok:
            raise ConfigError(msg)


def validate(cfg: Config) -> None:
    """Contradictions and impossible values; plugin-dependent checks live in `molt validate`."""
    t, r, s = cfg.trainer, cfg.rollout, cfg.sampling
    _require([
        (t.steps > 0, f"trainer.steps must be > 0 (got {t.steps})"),
        (not any(p.is_file() for p in (Path(cfg.out_dir).absolute(),
                                       *Path(cfg.out_dir).absolute().parents)),
         f"out_dir '{cfg.out_dir}' is (inside) a file, not a folder: set out_dir to a folder "
         "(runs go to out_dir/name-TIME)"),
        (t.num_ranks >= 1, f"trainer.num_ranks must be >= 1 (got {t.num_ranks})"),
        (t.save_every >= 0 and t.keep_last >= 1,
         "trainer.save_every must be >= 0 (0: only at the end) and trainer.keep_last >= 1"),
        (t.micro_batch_size >= 1, "trainer.micro_batch_size must be >= 1"),
        (t.lr > 0, f"trainer.lr must be > 0 (got {t.lr})"),
        (t.grad_clip > 0, f"trainer.grad_clip must be > 0 (got {t.grad_clip})"),
        (t.warmup_steps >= 0 and t.eps > 0, "trainer.warmup_steps must be >= 0, trainer.eps > 0"),
        (len(t.betas) == 2 and all(type_ok(b, float) and 0 <= b < 1 for b in t.betas),
         f"trainer.betas must be two numbers in [0, 1) (got {t.betas})"),
        (re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", cfg.name),
         f"name {cfg.name!r} must be a plain run name (letters, digits, _ . + -; no path "
         "separators): runs go to out_dir/name-TIME"),
        (t.weight_sync_transport != "broadcast" or not (0 < t.gpus_per_rank < 1
                                                  or 0 < cfg.engine.gpus_per_engine < 1),
         "trainer.weight_sync_transport=broadcast needs trainer and engines on separate GPUs "
         "(NCCL cannot hold two ranks of one GPU); with fractional gpus_per_rank/gpus_per_engine "
         "set trainer.weight_sync_transport=ray"),
        (t.moe_aux_loss_coef >= 0, "trainer.moe_aux_loss_coef must be >= 0 (0: off)"),
        (not (t.moe_aux_loss_coef > 0 and t.moe_routing == "freeze_router"),
         "trainer.moe_aux_loss_coef > 0 has no effect with trainer.moe_routing=freeze_router "
         "(the load-balancing loss only trains the router): set one of them differently"),
        (t.lora.rank >= 0 and t.lora.alpha > 0, "trainer.lora: rank must be >= 0 (0: off), alpha > 0"),
        (t.lora.dropout == 0, f"trainer.lora.dropout={t.lora.dropout}: Molt trains without adapter "
         "dropout (the ratio's log-probs must be those of the merged weights the engines sample, "
         "so a dropout forward would bias it); set trainer.lora.dropout=0"),
        (not (t.lora.rank and t.lora.sync == "adapter" and cfg.engine.name == "vllm"),
         "engine vllm cannot take LoRA adapters from the trainer yet (hf serves them unmerged): "
         "set trainer.lora.sync: merged"),
        (not (t.lora.rank and t.backend != "fsdp2"),
         f"trainer.lora needs trainer.backend=fsdp2 (got {t.backend})"),
        (cfg.eval.every >= 0 and cfg.eval.prompts >= 1 and cfg.eval.k >= 0,
         "eval: every must be >= 0 (0: off), prompts >= 1, k >= 0 (0: greedy only)"),
        (min(t.mini_batches, t.epochs, t.max_nonfinite_steps) >= 1,
         "trainer.mini_batches, trainer.epochs and trainer.max_nonfinite_steps must be >= 1"),
        (r.groups_per_step >= 1, "rollout.groups_per_step must be >= 1"),
        (0 <= cfg.agent.max_failure_rate <= 1, "agent.max_failure_rate must be in [0, 1]"),
        (r.group_size >= 1, "rollout.group_size must be >= 1"),
        (r.max_staleness is None or r.max_staleness >= 0, "rollout.max_staleness must be >= 0"),
        (s.temperature > 0, "sampling.temperature must be > 0 (use a small value for near-greedy)"),
        (0 < s.top_p <= 1, "sampling.top_p must be in (0, 1]"),
        (s.max_new_tokens >= 1, "sampling.max_new_tokens must be >= 1"),
        (cfg.engine.num_engines >= 1 and cfg.engine.max_restarts >= 0,
         "engine.num_engines must be >= 1 and engine.max_restarts >= 0"),
        (cfg.log.trajectories_every >= 0 and cfg.log.trajectories_per_step >= 0,
         "log.trajectories_every and log.trajectories_per_step must be >= 0 (0: off / all)"),
    ])
    _require([(getattr(sec, f.name) > 0, f"{where}.{f.name} must be > 0 seconds (got "
               f"{getattr(sec, f.name)})") for where, sec in vars(cfg).items()
              if dataclasses.is_dataclass(sec)
              for f in dataclasses.fields(sec) if f.name.endswith("timeout_s")])
    _validate_algorithm(cfg)
    _require([(cfg.model.path, "model.path is missing: set it to a local HF model directory "
                               "(make one with `molt tiny-model DIR`)"),
              ((Path(cfg.model.path) / "config.json").is_file(),
               f"model.path '{cfg.model.path}' has no config.json: point it at a local HF model "
               "directory (make a tiny one with `molt tiny-model DIR`)")])
    _validate_parallel(cfg)


def model_facts(path: str) -> dict[str, int]:
    """From a model's config.json: `num_experts` (0: dense) and `mtp_layers` (0: no MTP head)."""
    try:
        c = json.loads((Path(path) / "config.json").read_text())
        if not isinstance(c, dict) or "model_type" not in c:
            raise ValueError("not a JSON object with a model_type")
        c = {**c, **(c.get("text_config") or {})}
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{path}/config.json is not a valid model config ({e}); restore it from "
                          "the model's source") from None
    experts = next((c[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if c.get(k)), 0)
    mtp = next((c[k] for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers") if c.get(k)), 0)
    return {"num_experts": int(experts), "mtp_layers": int(mtp)}


def _validate_parallel(cfg: Config) -> None:
    """Parallelism as configuration: sizes that cannot tile the ranks, or that the backend, the
    model or the engine cannot run, are rejected here with the reason."""
    t, e = cfg.trainer, cfg.engine
    _require([(min(t.tp_size, t.cp_size, t.ep_size, e.tensor_parallel_size) >= 1 and t.dp_size >= 0,
               "trainer.tp_size, cp_size, ep_size and engine.tensor_parallel_size must be >= 1, "
               "trainer.dp_size >= 0 (0: inferred)")])
    inner = t.tp_size * t.cp_size
    _require([
        ((t.dp_size or t.num_ranks // inner) * inner == t.num_ranks,
         f"trainer.num_ranks={t.num_ranks} is not dp_size*tp_size*cp_size = {t.dp_size or '?'}"
         f"*{t.tp_size}*{t.cp_size}: each trainer rank is one (data, tensor, context) "
         f"parallel position; set num_ranks to a multiple of tp*cp={inner} (dp_size 0 infers it)"),
        (t.backend != "fsdp2" or max(t.tp_size, t.cp_size, t.ep_size) == 1,
         f"trainer.backend=fsdp2 shards parameters over data-parallel ranks only; tp_size="
         f"{t.tp_size}, cp_size={t.cp_size}, ep_size={t.ep_size} need trainer.backend=automodel "
         "(GPU), or set them to 1"),
        (t.cp_size == 1,
         f"trainer.cp_size={t.cp_size}: context parallelism is not supported by Molt's log-prob "
         "path yet (it needs sequence-sharded log-probs without padding masks, per-sequence "
         "sums across CP ranks, and no packed batches); set cp_size=1 and use tp_size or more "
         "data-parallel ranks for long sequences")])
    facts = model_facts(cfg.model.path)
    n, ep = facts["num_experts"], t.ep_size
    _require([] if ep == 1 else [
        (n, f"trainer.ep_size={ep} on a dense model ({cfg.model.path} has no experts in its "
            "config.json): set ep_size=1"),
        (not (n % ep or t.num_ranks % ep), f"trainer.ep_size={ep} must divide the model's "
         f"num_experts ({n}) and trainer.num_ranks ({t.num_ranks})"),
        (t.moe_routing == "off",
         f"trainer.ep_size={ep} runs AutoModel's own MoE layers, to which routing replay and "
         f"router freezing are not wired: set trainer.moe_routing=off (got {t.moe_routing}), or "
         "ep_size=1 to keep the HF MoE layers and replay"),
        (not t.moe_aux_loss_coef,
         f"trainer.moe_aux_loss_coef acts on the HF MoE layers; with ep_size={ep} AutoModel's MoE "
         "layers apply their own load-balancing loss (the checkpoint's router_aux_loss_coef): "
         "set trainer.moe_aux_loss_coef=0")])
    owned = sorted({"dtype", "max_batch_size", "seed", "tensor_parallel_size"} & set(e.args))
    method = str(e.speculative.get("method", ""))
    _require([
        (e.name == "vllm" or (e.tensor_parallel_size == 1 and not e.speculative),
         f"engine.tensor_parallel_size and engine.speculative need engine.name=vllm (engine "
         f"'{e.name}' runs one unsharded model, no draft)"),
        (not (owned or (e.speculative and "speculative_config" in e.args.get("engine_kwargs", {}))),
         f"engine.args sets {owned or ['engine_kwargs.speculative_config']}, which come from "
         "model.dtype, engine.max_batch_size, seed, engine.tensor_parallel_size and "
         "engine.speculative: set them there"),
        ("mtp" not in method or facts["mtp_layers"],
         f"engine.speculative method '{method}' needs a model with an MTP head; {cfg.model.path} "
         "has none (no num_nextn_predict_layers or mtp_num_hidden_layers in config.json): drop "
         "engine.speculative or use method ngram")])


def _validate_algorithm(cfg: Config) -> None:
    from molt_core.algos import CORRECTIONS
    a, r = cfg.algorithm, cfg.rollout
    _require([(getattr(a.terms, k) >= 0, f"algorithm.terms.{k} must be >= 0 (got "
               f"{getattr(a.terms, k)})")
              for k in ("kl_coef", "entropy_coef", "value_coef", "value_clip", "value_lr")])
    _require([(a.correction in CORRECTIONS, f"algorithm.correction '{a.correction}' unknown; "
               f"valid: {', '.join(CORRECTIONS)}")])
    known = CORRECTIONS[a.correction]
    th = {**known, **a.correction_args}
    _require([
        (not set(a.correction_args) - set(known),
         f"algorithm.correction_args {sorted(set(a.correction_args) - set(known))} not "
         f"understood by correction '{a.correction}'; it takes {sorted(known)}"),
        (all(isinstance(v, (int, float)) and v > 0 for v in th.values())
         and not th.get("low", 0) > th.get("high", float("inf")),
         f"algorithm.correction_args {th}: thresholds must be positive numbers with low <= high"),
        (not r.max_inflight_groups or r.max_inflight_groups >= r.groups_per_step,
         f"rollout.max_inflight_groups ({r.max_inflight_groups}) must be 0 or >= "
         f"rollout.groups_per_step ({r.groups_per_step})")])
    _validate_sampling(cfg.sampling)


def _validate_sampling(s: SamplingConfig) -> None:
    """The trainer computes log-probs of the full softmax at `temperature`; the loss and the
    importance weights compare them with the engine's behavior log-probs, so sampling that the
    trainer does not reproduce is rejected rather than silently biasing every update."""
    why = {"top_k": (s.top_k > 0, 0), "top_p": (s.top_p < 1, 1.0), "min_p": (s.min_p > 0, 0.0),
           "repetition_penalty": (s.repetition_penalty != 1, 1.0)}
    _require([(not on, f"sampling.{key}={getattr(s, key)}: the trainer cannot reproduce it, so "
               "the behavior log-probs disagree with the trainer's ("
               + ("the hf engine records them after the penalty, vLLM too"
                  if key == "repetition_penalty" else
                  "tokens are drawn from a truncated distribution; vLLM reports log-probs "
                  "renormalised over the kept tokens, the hf engine those of the full one")
               + f") and every ratio and importance weight is biased. Set sampling.{key}={off}")
              for key, (on, off) in why.items()])

