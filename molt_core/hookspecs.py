"""Every extension point of Molt. A plugin is a module with functions decorated `@molt.hookimpl`.

Registration hooks return `{name: object}` (objects as `molt_core.contracts` declares them); the
core merges them across plugins and raises on a duplicate or unknown name, listing the valid ones.
Pipeline hooks fire at named points of the training loop (`trainer.py`). Docs: docs/plugins.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

from molt_core import hookimpl

if TYPE_CHECKING:
    from molt_core.config import Config
    from molt_core.plugins import Plugins
    from molt_core.trajectory import Trajectory

hookspec = pluggy.HookspecMarker("molt")

__all__ = ["hookimpl", "hookspec"]


@hookspec
def molt_estimators() -> dict[str, Callable]:
    """Register advantage estimators: `{name: fn}`, `fn(rewards[R], group_index[R], **kwargs) ->
    advantages[R]` (`group_index` long). With `fn.needs_values = True`, per token with the critic's
    values: `fn(rewards[B, T], values[B, T], mask[B, T], group_index[B], **kwargs) ->
    (advantages[B, T], returns[B, T])` (`molt_core.advantage`). With `fn.per_turn = True`,
    advantages[R, K]: per model call (`Trajectory.turns`). kwargs: `algorithm.estimator_args`."""


@hookspec
def molt_losses() -> dict[str, Callable]:
    """Register policy losses: `{name: fn}`, `fn(logprobs, behavior_logprobs, advantages, mask,
    **kwargs) -> (per_token_loss, metrics)`, all [B, T], aggregated with `algorithm.loss_agg` over
    the optimizer step; `metrics` values are [B, T] (token-mean over `mask`) or scalars. kwargs:
    `algorithm.loss_args`."""


@hookspec
def molt_rewards() -> dict[str, Callable]:
    """Register reward functions (for environments and agents): `{name: fn}`, `fn(response: str,
    answer: str, **kwargs) -> (reward: float, info: dict)`; on bad model output it never raises
    but returns 0.0 with `info["reason"]` (e.g. `"timeout"`)."""


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
    """Register plugin config sections: `{section: dataclass}`, the YAML mapping under `section`
    built into it (unknown keys are errors) as `cfg.plugins[section]`."""


@hookspec
def molt_configure(cfg: Config, plugins: Plugins) -> None:
    """Once the config is loaded, before any process starts (take either argument or both): raise
    `ConfigError` to reject a combination; `plugins.check_args(where, kind, name, kwargs)` checks
    arguments your plugin passes on to another registered entry (e.g. an agent's env)."""


@hookspec
def molt_filter_batch(groups: list[list[Trajectory]], step: int,
                      refill: Callable[[int], list[list[Trajectory]]]
                      ) -> list[list[Trajectory]] | None:
    """Filter or reshape a batch's groups before advantages; chained (each gets the previous
    result). `refill(n)`: `n` more complete groups (blocking; the scheme's `refill` if it has one),
    so a filter can keep the batch size (DAPO dynamic sampling). Returns the new groups, or None
    for unchanged; an empty list skips the step's update (`trainer/empty_batches`)."""


@hookspec
def molt_on_step_end(step: int, metrics: dict[str, Any]) -> None:
    """Called after each training step with its metrics (may add entries to `metrics`)."""


@hookspec
def molt_chat_agents() -> dict[str, type]:
    """Register chat agents of the `chat` agent: `{name: cls}`, a `molt_chat.ChatAgent` with
    `async run(ctx) -> float | list[float]`, one instance per rollout, picked by
    `agent.args.agent` and built with `agent.args.agent_args`."""


@hookspec
def molt_metric_sinks() -> dict[str, Callable]:
    """Register metric sinks (TensorBoard, W&B, ...), selected by `log.sinks: [name, ...]`:
    `{name: factory}`, `factory(run_dir: Path | None, cfg: Config) -> sink` (a
    `molt_core.contracts.MetricSink`: `log(step, metrics)`, `close()`)."""


@hookspec
def molt_cli_commands() -> dict[str, tuple[str, str, str]]:
    """Register `molt` subcommands (front ends such as `molt serve-tinker`): `{name: (help,
    add_args, main)}`, the last two "module:function" strings imported only when the command
    runs: `add_args(parser)`, `main(args) -> exit code`. A name the core has is an error."""


@hookspec
def molt_state_dict() -> dict[str, Any] | None:
    """A stateful plugin's state for checkpoints (e.g. a filter's carried-over groups): plain data
    that `torch.load(weights_only=True)` reads back, or None. Saved per plugin name with every
    checkpoint, handed back to its `molt_load_state_dict` on `--resume`."""


@hookspec
def molt_load_state_dict(state: dict[str, Any]) -> None:
    """Restore what this plugin's `molt_state_dict` returned, when a run resumes from a
    checkpoint (before the first resumed step). Not called when the checkpoint holds none."""
