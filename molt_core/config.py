"""Typed run configuration: dataclasses loaded from YAML (`safe_load`) plus `a.b=c` overrides.

Every error is a `ConfigError` raised before any process starts; its message names the key and
the fix. Plugin-specific options live under the plugin's own section (`molt_config_sections`)."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from molt_core.config_rules import ConfigError, type_ok, validate

__all__ = ["AgentConfig", "AlgorithmConfig", "CheckConfig", "Config", "ConfigError", "EngineConfig",
           "EvalConfig", "LogConfig", "LoraConfig", "LossTermsConfig", "ModelConfig", "RayConfig",
           "RolloutConfig", "SamplingConfig", "TrainerConfig", "apply_overrides", "from_dict",
           "load_config", "to_dict", "type_name", "type_ok"]


@dataclass
class ModelConfig:
    path: str = ""                       # local HF directory (config.json + weights + tokenizer)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"   # CPU: float32
    chat_template: str = ""              # a .jinja file that replaces the tokenizer's template
    # a `molt sft`/`molt run` RUN_DIR or checkpoint to start from: model.path := its final/ (or
    # CHECKPOINT/hf, exported), model.init_from := the checkpoint (the lineage, in config.yaml)
    init_from: str = ""
    # merge: train its merged weights (trainer.lora: new adapters on them); carry: trainer.lora
    # starts from its adapters (same rank, alpha, target_modules)
    init_lora: Literal["merge", "carry"] = "merge"


@dataclass
class SamplingConfig:
    # Every knob is sent explicitly so a checkpoint's generation_config never changes sampling.
    temperature: float = 1.0
    top_k: int = 0                       # 0 = off
    top_p: float = 1.0                   # nucleus sampling; 1 = off
    min_p: float = 0.0                   # 0 = off
    repetition_penalty: float = 1.0      # 1 = off
    max_new_tokens: int = 16             # tokens per engine call (per turn)


@dataclass
class EngineConfig:
    name: str = "hf"                     # rollout engine: hf (embedded) | vllm
    num_engines: int = 1                 # engine replicas (Ray actors)
    max_batch_size: int = 256            # requests decoded together in one batch
    timeout_s: float = 300.0             # one generate call
    max_restarts: int = 3                # engine actors that die are replaced this often per run
    cpus_per_engine: float = 0.0         # 0: do not reserve Ray CPUs (small CPU runs)
    tensor_parallel_size: int = 1        # GPUs one engine shards its model over (vllm)
    gpus_per_engine: float = -1.0        # -1: tensor_parallel_size if the Ray cluster has GPUs
    resources: dict = field(default_factory=dict)   # custom Ray resources per engine (placement)
    speculative: dict = field(default_factory=dict)   # vLLM speculative_config as is; {}: off
    # More keyword arguments of the engine class (vllm: gpu_memory_utilization, max_model_len,
    # enforce_eager, engine_kwargs for any other vLLM engine argument, ...).
    args: dict = field(default_factory=dict)


@dataclass
class LoraConfig:
    """PEFT LoRA adapters: only they train (and hold AdamW state)."""
    rank: int = 0                        # 0: off (full fine-tuning)
    alpha: float = 16.0
    dropout: float = 0.0                 # must be 0: a dropout forward would bias the PPO ratio
    target_modules: str | list = "all-linear"   # PEFT names; all-linear: every Linear but lm_head
    # what a weight sync pushes: merged (every base weight, adapted ones as W + s B A) | adapter
    # (A, B and s = alpha / rank only; engine hf applies them unmerged, vllm cannot yet)
    sync: Literal["merged", "adapter"] = "merged"


@dataclass
class TrainerConfig:
    backend: str = "fsdp2"               # fsdp2 | automodel (GPU)
    num_ranks: int = 1                   # trainer processes (one GPU each on GPU)
    # Parallelism: num_ranks = dp * tp * cp; dp 0 = num_ranks / (tp * cp). ep shards MoE experts
    # over dp*cp*tp ranks. tp/cp/ep need backend automodel; fsdp2 shards parameters only (dp).
    dp_size: int = 0
    tp_size: int = 1                     # tensor parallel (automodel)
    cp_size: int = 1                     # context parallel (not supported yet)
    ep_size: int = 1                     # expert parallel, MoE (automodel)
    optimizer_offload: bool = False      # FSDP2 CPUOffloadPolicy: params, grads, AdamW on CPU
    gpus_per_rank: float = -1.0          # -1: 1 if the Ray cluster has GPUs, else 0
    cpus_per_rank: float = 0.0           # Ray CPUs reserved per rank (0: none, small CPU runs)
    in_driver: bool = True               # one CPU rank reserving nothing (resources, CPUs):
                                         # in the driver's process, no Ray hop (~3.5 ms a call)
    resources: dict = field(default_factory=dict)   # custom Ray resources per rank (placement)
    steps: int = 100                     # optimizer steps (one rollout batch each)
    save_every: int = 0                  # checkpoint every N steps (0: only at the end)
    keep_last: int = 2                   # checkpoints kept (older ones are deleted)
    lr: float = 1e-3                     # AdamW learning rate (lr_schedule's peak; train/lr)
    # lr over the run's optimizer steps (steps x mini_batches x epochs), after warmup_steps from
    # 0: constant, linear to 0 (TRL's default) or cosine to 0 (HF's get_*_schedule_with_warmup)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0                # optimizer steps of linear warmup from 0 to lr
    weight_decay: float = 0.0            # AdamW weight decay; none on biases and norm weights (HF)
    betas: list = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    eps: float = 1e-8                    # AdamW epsilon
    grad_clip: float = 1.0               # max total gradient norm
    micro_batch_size: int = 64           # sequences per forward/backward on one rank
    # Optimizer steps per rollout batch = mini_batches * epochs (each epoch splits the batch's rows
    # into mini_batches parts). More than one step: pi_prox (the log-probs before the first step)
    # is computed once per batch and the loss's ratio/clip acts against it (decoupled PPO).
    mini_batches: int = 1                # optimizer steps per epoch over one rollout batch
    epochs: int = 1                      # passes over one rollout batch
    max_nonfinite_steps: int = 3         # steps in a row with a NaN/inf loss or grad norm: abort
    dead_run_steps: int = 5              # steps in a row with every group flat (one reward) or
                                         # nothing to train: warn once, with the fixes (0: never)
    logprob_chunk: int = 1024            # trainable tokens per lm_head chunk
    timeout_s: float = 300.0             # collectives and trainer RPCs
    weight_sync_bucket_mb: float = 64.0  # tensors per weight-sync bucket
    weight_sync_timeout_s: float = 120.0   # every sync RPC and collective
    # broadcast: a gloo/NCCL group (across nodes) | ray: Ray objects (trainer and engine on one
    # GPU) | shm: shared-memory files (one node; fastest on one CPU box); docs/scaling.md
    weight_sync_transport: Literal["broadcast", "ray", "shm"] = "broadcast"
    # MoE policies: replay (the trainer's forward uses the experts the engine routed each sampled
    # token to; R3) | off (the trainer recomputes routing) | freeze_router (recompute; router
    # weights get no updates). Ignored for dense models.
    moe_routing: Literal["replay", "off", "freeze_router"] = "replay"
    # MoE: weight of the load-balancing loss (Switch Transformer; logged as moe/aux_loss). 0: off
    moe_aux_loss_coef: float = 0.0
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class LossTermsConfig:
    """Terms the trainer adds to any loss's per-token value (formulas: `molt_core.algos`)."""
    kl_coef: float = 0.0                 # KL(pi || pi_ref), pi_ref = frozen initial weights
                                         # (loaded only when > 0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"   # Schulman's KL estimators
    kl_in: Literal["loss", "reward"] = "loss"   # loss: + kl_coef * kl_t per token | reward:
                                         # r_t -= kl_coef * kl_t (detached, behavior log-probs)
    entropy_coef: float = 0.0            # - entropy_coef * H(pi(.|s_t)) per token
    value_coef: float = 0.5              # critic loss weight (estimators that need values: ppo)
    value_clip: float = 0.2              # critic clip range around the pre-update values; 0: off
    value_lr: float = 0.0                # critic learning rate; 0: trainer.lr


@dataclass
class AlgorithmConfig:
    estimator: str = "grpo"              # advantage estimator (molt_estimators)
    estimator_args: dict = field(default_factory=dict)  # its keyword arguments
    loss: str = "ppo_clip"               # policy loss (molt_losses)
    loss_args: dict = field(default_factory=dict)  # its keyword arguments
    # how per-token values become the loss: mean over all tokens | per sequence, then mean
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    # Off-policy correction against the engine's behavior log-probs: none | tis | icepop | mis |
    # geo_mask (formulas and default thresholds: molt_core.algos.is_correction, docs/algorithms.md)
    correction: str = "none"
    correction_args: dict = field(default_factory=dict)  # thresholds, e.g. tis {cap: 2.0}
    terms: LossTermsConfig = field(default_factory=LossTermsConfig)


@dataclass
class RolloutConfig:
    scheme: str = "sync"                 # sync | async | partial (molt_rollout_schemes)
    groups_per_step: int = 8             # prompt groups in one training batch
    group_size: int = 8                  # rollouts per prompt group
    max_staleness: int | None = None     # weight versions a trainable token may lag; unset:
                                         # async/partial ceil(pool / groups_per_step), >= 1
    stale: Literal["drop", "mask"] = "drop"    # drop the whole group | mask the stale tokens
    # streaming pool (async/partial): groups running or finished-and-waiting; 0 = groups_per_step
    # (one batch ahead; more lets fast groups go first, but the surplus ages past max_staleness)
    max_inflight_groups: int = 0
    # async: batch i is sampled by exactly the weights of version max(0, i - max_staleness)
    # (one batch at a time, overlapping the training steps), so a seed fixes the run bit for bit
    deterministic: bool = False


@dataclass
class AgentConfig:
    name: str = "gym"                    # agent type (molt_agents): gym | chat
    args: dict = field(default_factory=dict)   # the agent's keyword arguments
    timeout_s: float = 600.0             # one rollout
    # Failed rollouts (agent errors, timeouts, non-finite rewards) are dropped alone; the run
    # aborts, naming the commonest error, once more than this fraction of rollouts failed.
    max_failure_rate: float = 0.5


@dataclass
class CheckConfig:
    consistency_every: int = 10          # steps between engine-vs-trainer log-prob checks (0: off)
    consistency_tol: float = 0.0         # max |engine - trainer| log-prob on on-policy tokens;
                                         # 0: by model.dtype (fp32 1e-3, bf16/fp16 1.0)
    canary_every: int = 10               # weight syncs between canary checks, from the 1st (0: off)


@dataclass
class EvalConfig:
    """Held-out evaluation (`molt_core.rollout.eval`): before step 0, every `every` steps, at the end."""
    every: int = 0                       # steps between evaluations; 0: off
    prompts: int = 32                    # held-out prompts (tasks disjoint from training's)
    k: int = 4                           # sampled rollouts per prompt for pass@k (0: greedy only)
    success: float = 1.0                 # a rollout is solved when its reward >= success
    agent_args: dict = field(default_factory=dict)   # merged over agent.args, e.g.
                                                     # {env_args: {split: test}}


@dataclass
class RayConfig:
    address: str = ""                    # empty: start a local Ray
    num_cpus: int = 0                    # local Ray only; 0 = all cores
    embedded: Literal["auto", "on", "off"] = "auto"   # on: no Ray; the engine runs on a thread
    # of the driver. auto: on where nothing needs Ray (no ray.address, one hf engine and one
    # trainer rank reserving nothing, no GPU); off: Ray always


@dataclass
class LogConfig:
    trajectories_every: int = 1          # save the trained trajectories every N steps (0: off)
    trajectories_per_step: int = 0       # rollouts saved per saved step (0: all)
    format: Literal["console", "json"] = "console"   # json: structlog JSON lines on stderr
    sinks: list = field(default_factory=list)   # metric sinks (molt_metric_sinks): tensorboard..


@dataclass
class SftConfig:
    """`molt sft` (`molt_core.sft_trainer`): supervised fine-tuning on chat rows; the trainer,
    LoRA, lr schedule and checkpoints are `trainer.*`'s (its steps: these)."""
    data: str = ""                       # JSONL/Parquet/CSV file or `datasets` dir: messages
                                         # (+ tools) or prompt/completion rows
    epochs: int = 1                      # passes over the training rows (when steps is 0)
    steps: int = 0                       # optimizer steps; 0: epochs x rows / batch_size
    batch_size: int = 8                  # rows per optimizer step
    eval_fraction: float = 0.1           # held-out rows for eval/loss (by a hash of the row)
    eval_every: int = 0                  # steps between eval/loss rows (0: first and last only)
    max_tokens: int = 0                  # a longer row is an error; 0: the model's context
    skip_bad_rows: bool = False          # bad rows skipped, counted (sft/skipped_rows), warned
                                         # once; false: the first is an error naming it


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    seed: int = 0                        # seeds sampling, init and tasks
    name: str = "run"                    # run directory prefix
    out_dir: str = "runs"                # run directories go under it
    plugins: dict = field(default_factory=dict)   # plugin sections: {section: dataclass instance}


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{where or 'config'}': expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "plugins"]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)     # the hint first
            raise ConfigError(f"unknown config key '{path}'; " + (f"did you mean '{close[0]}'? "
                              if close else "") + f"valid keys here: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value if value is not None else {}, path)
        elif not type_ok(value, tp):
            raise ConfigError(f"config key '{path}' must be {type_name(tp)}, got {value!r} "
                              f"({type(value).__name__})")
        else:
            kwargs[key] = float(value) if tp is float else value
    return cls(**kwargs)


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    return "a finite float" if tp is float else getattr(tp, "__name__", str(tp))


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return [to_dict(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=c` overrides to a raw config dict; values are parsed as YAML scalars."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. trainer.steps=50)")
        node, parts = data, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        # YAML 1.1 reads on/off/yes/no as booleans: on the command line they stay words
        # (trainer.moe_routing=off); booleans are written true/false.
        words = raw.lower() in ("on", "off", "yes", "no", "y", "n")
        try:
            node[parts[-1]] = raw if words else safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': the value is not valid YAML "
                              f"({_yaml_problem(e)}); quote text, close brackets") from None
    return data


class _Loader(yaml.SafeLoader):
    """`yaml.safe_load` plus YAML 1.2's floats without a dot: YAML 1.1 reads `lr: 3e-4` as a
    string, which nobody writing a learning rate means."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789."))


def safe_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)   # noqa: S506 (a SafeLoader)


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{getattr(e, 'problem', None) or e}{where}"


def load_config(path: str | Path | None, overrides: list[str] = (),
                sections: dict[str, type] | None = None, resolve: Any = None) -> Config:
    """Load a recipe, apply overrides, build typed sections (core + plugin), `resolve(cfg)` (the
    CLI's: model.init_from), validate."""
    data: dict = {}
    if path is not None:
        if not (p := Path(path)).is_file():
            raise ConfigError(f"recipe '{path}' does not exist")
        try:
            data = safe_load(p.read_text()) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"recipe '{path}' is not a text file (binary?); pass a YAML "
                              "recipe") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe '{path}' is not valid YAML: {_yaml_problem(e)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"recipe '{path}' must be a YAML mapping at top level")
    data = apply_overrides(data, list(overrides))
    sections = sections or {}
    if clash := {f.name for f in dataclasses.fields(Config)} & set(sections):
        raise ConfigError(f"plugin config sections {sorted(clash)} clash with core sections")
    plugin_data = {k: data.pop(k) for k in list(data) if k in sections}
    try:
        cfg = from_dict(Config, data)
    except ConfigError as e:
        if "unknown config key" in str(e) and sections:
            raise ConfigError(f"{e}; plugin sections: {', '.join(sorted(sections))}") from None
        raise
    cfg.plugins = {name: from_dict(cls, plugin_data.get(name, {}), name)
                   for name, cls in sections.items()}
    if path is not None:
        _near_recipe(cfg, Path(path).parent)
    if resolve:
        resolve(cfg)
    validate(cfg)
    return cfg


def _near_recipe(cfg: Config, folder: Path) -> None:
    """model.path, chat_template and init_from, sft.data and the env's `data` (a file or
    {split: file}, in agent.args and eval.agent_args) that do not exist from the working directory
    but do next to the recipe are read there."""
    def near(p: Any) -> Any:
        if isinstance(p, dict):
            return {k: near(v) for k, v in p.items()}
        return str(folder / p) if isinstance(p, str) and p and not Path(p).exists() and (
            folder / p).exists() else p
    m = cfg.model
    m.path, m.chat_template, m.init_from = near(m.path), near(m.chat_template), near(m.init_from)
    cfg.sft.data = near(cfg.sft.data)
    for args in (cfg.agent.args, cfg.eval.agent_args):
        if isinstance(env := args.get("env_args"), dict) and "data" in env:
            env["data"] = near(env["data"])
