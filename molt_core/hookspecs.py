"""Every extension point of Molt. A plugin is a module with functions decorated `@molt.hookimpl`.

Registration hooks return `{name: object}` (objects as `molt_core.contracts` declares them); the
core merges them across plugins and raises on a duplicate or unknown name, listing the valid ones.
Pipeline hooks fire at named points of the training loop (`trainer.py`). Docs: docs/plugins.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from molt_core.config import Config
    from molt_core.plugins import Plugins
    from molt_core.trajectory import Trajectory

hookspec = pluggy.HookspecMarker("molt")
hookimpl = pluggy.HookimplMarker("molt")

__all__ = ["hookimpl", "hookspec"]


@hookspec
def molt_estimators() -> dict[str, Callable]:
    """Register advantage estimators.

    Returns `{name: fn}` with `fn(rewards[R], group_index[R], **kwargs) -> advantages[R]` (float
    tensors; `group_index` long). An estimator with `fn.needs_values = True` works per token with
    the critic's values instead: `fn(rewards[B, T], values[B, T], mask[B, T], group_index[B],
    **kwargs) -> (advantages[B, T], returns[B, T])` (see `molt_core.advantage`). Keyword arguments
    come from `algorithm.estimator_args`.
    """


@hookspec
def molt_losses() -> dict[str, Callable]:
    """Register policy losses.

    Returns `{name: fn}` with `fn(logprobs, behavior_logprobs, advantages, mask, **kwargs) ->
    (per_token_loss, metrics)`, all tensors [B, T]. The trainer aggregates `per_token_loss` with
    `algorithm.loss_agg` over the whole optimizer step; `metrics` values are [B, T] (token-mean
    over `mask`) or scalars. Keyword arguments come from `algorithm.loss_args`.
    """


@hookspec
def molt_rewards() -> dict[str, Callable]:
    """Register reward functions (used by environments and agents, not by the trainer).

    Returns `{name: fn}` with `fn(response: str, answer: str, **kwargs) -> (reward: float, info:
    dict)`; `info` says why (e.g. `{"reason": "timeout"}`). A reward function never raises on bad
    model output: it returns 0.0 with a reason.
    """


@hookspec
def molt_agents() -> dict[str, Callable]:
    """Register agent types: `{name: factory}`, `factory(cfg, tokenizer, plugins, **agent.args)
    -> agent` (a `molt_core.contracts.Agent`: `async rollout(ctx) -> Trajectory`)."""


@hookspec
def molt_envs() -> dict[str, Callable]:
    """Register Gym-style environments: `{name: class}`, each a `molt_core.contracts.Env`."""


@hookspec
def molt_engines() -> dict[str, type]:
    """Register rollout engines: `{name: class}`, each a `molt_core.contracts.Engine`."""


@hookspec
def molt_trainer_backends() -> dict[str, type]:
    """Register trainer backends: `{name: class}`, each a `molt_core.contracts.TrainerBackend`."""


@hookspec
def molt_rollout_schemes() -> dict[str, Callable]:
    """Register rollout schemes: `{name: factory}`, `factory(cfg, generator, policy, engines)
    -> scheme` (a `molt_core.contracts.RolloutScheme`: `next_batch`, `sync_weights`, `version`)."""


@hookspec
def molt_config_sections() -> dict[str, type]:
    """Register plugin config sections: `{section: dataclass}`.

    The YAML mapping under `section` is built into the dataclass (unknown keys are errors) and
    is available as `cfg.plugins[section]`.
    """


@hookspec
def molt_configure(cfg: Config, plugins: Plugins) -> None:
    """Called once after the config is loaded and before any process starts (take either
    argument or both).

    Raise `molt_core.config.ConfigError` to reject a combination your plugin cannot run with;
    `plugins.check_args(where, kind, name, kwargs)` checks arguments your plugin passes on to
    another registered entry (e.g. an agent's env).
    """


@hookspec
def molt_filter_batch(groups: list[list[Trajectory]], step: int,
                      refill: Callable[[int], list[list[Trajectory]]]
                      ) -> list[list[Trajectory]] | None:
    """Filter or reshape the groups of a training batch before advantages are computed.

    `refill(n)` returns `n` more complete groups (blocking; the rollout scheme's `refill` when it
    has one, e.g. from the streaming pool), so a filter can keep the batch
    size (e.g. DAPO dynamic sampling). Return the new list of groups, or None to leave it
    unchanged; an empty list skips the step's update (counted as `trainer/empty_batches`).
    Implementations are chained: each receives the previous one's result.
    """


@hookspec
def molt_on_step_end(step: int, metrics: dict[str, Any]) -> None:
    """Called after each training step with its metrics (may add entries to `metrics`)."""


@hookspec
def molt_chat_agents() -> dict[str, type]:
    """Register chat agents for the `chat` agent (plugin `molt-agent-chat`).

    Returns `{name: cls}`: a `molt_chat.ChatAgent` subclass with `async run(ctx) -> float |
    list[float]`; `agent.args.agent` picks it and `agent.args.agent_args` are its constructor
    arguments. One instance per rollout.
    """


@hookspec
def molt_metric_sinks() -> dict[str, Callable]:
    """Register metric sinks (TensorBoard, W&B, ...), selected by `log.sinks: [name, ...]`:
    `{name: factory}`, `factory(run_dir: Path | None, cfg: Config) -> sink` (a
    `molt_core.contracts.MetricSink`: `log(step, metrics)`, `close()`)."""


@hookspec
def molt_state_dict() -> dict[str, Any] | None:
    """State of a stateful plugin to keep in checkpoints (e.g. a filter's carried-over groups).

    Return plain data (dicts, lists, numbers, strings, tensors; `torch.load(weights_only=True)`
    must read it back), or None for nothing. Saved per plugin (by plugin name) with every
    checkpoint and handed back to the same plugin's `molt_load_state_dict` on `--resume`.
    """


@hookspec
def molt_load_state_dict(state: dict[str, Any]) -> None:
    """Restore what this plugin's `molt_state_dict` returned, when a run resumes from a
    checkpoint (before the first resumed step). Not called when the checkpoint holds none."""
