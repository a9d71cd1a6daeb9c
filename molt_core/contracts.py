"""What plugins hand to the core, as `typing.Protocol`s, and what the core hands to agents; the
long form is docs/plugins.md, and `tests/test_contracts.py` holds every shipped implementation to
these names, parameters and async-ness. Tensors are CPU tensors; [B, T] is a `collate` batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, runtime_checkable

from molt_core.trajectory import Completion, ImageInput, Trajectory

if TYPE_CHECKING:
    import torch

    from molt_core.config import TrainerConfig
    from molt_core.policy.objective import TrainStep

__all__ = ["Agent", "Engine", "Env", "MetricSink", "Observation", "RolloutContext",
           "RolloutGenerator", "RolloutScheme", "TrainerBackend", "WeightPusher"]

Observation = str | list[dict]      # a user message, or chat messages (content may hold images)


@dataclass
class RolloutContext:
    """What an agent gets for one rollout."""
    group_id: int
    rollout_id: int
    task: int                                   # task index: env seed or dataset row
    sampling: dict                              # explicit sampling params for the engine
    generate: Callable[..., Awaitable[Completion]]   # (prompt_ids, sampling=None, images=None)
    tokenizer: Any


@runtime_checkable
class Engine(Protocol):
    """A rollout engine (`molt_engines`). The core runs it as a Ray actor (`ray.remote(cls)`), or
    embedded as an `actors.LocalActor`, and calls every method by `.remote()`; a failed call
    raises, a dead actor is replaced. Optional: `async rng_state()` / `set_rng_state(state)`, the
    sampling RNG kept in checkpoints; transports `broadcast` and `shm`: `weight_sync.Receiver`."""

    def __init__(self, model_path: str, *, dtype: str, max_batch_size: int, seed: int,
                 num_threads: int) -> None:
        """`model.*`, `engine.max_batch_size`, its seed, its threads; each `engine.args` too."""

    async def generate_batch(self, prompts: list[list[int]], samplings: list[dict],
                             images: list[list[ImageInput]] | None = None,
                             request_ids: list[str] | None = None) -> list[Completion | Exception]:
        """A `Completion` per prompt (ids, behavior log-probs, versions), a failed request's
        exception in its place. Sampling dicts hold exactly `engines.SAMPLING_KEYS` (+
        `stop_token_ids`); `images[i]`: prompt i's (VL); `request_ids`: for `abort`."""

    async def abort(self, request_ids: list[str]) -> None:
        """The caller gave up on these: stop them (`molt_core.engines.Requests` keeps track)."""

    async def pause(self) -> None:
        """Stop decoding after the current step; requests in flight keep their state."""

    async def resume(self) -> None:
        """Undo `pause` (decoding stays blocked while a weight update is open)."""

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]],
                             version: int) -> None:
        """One bucket of full tensors by HF name; the first of `version` blocks decoding until
        `finish_weight_update`. A wrong name, shape or dtype: ValueError, the update left open."""

    async def finish_weight_update(self, version: int) -> dict[str, int] | None:
        """Serve `version`; RuntimeError (update left open) if a parameter was not assigned.
        May return {name: `weight_sync.checksums` value} of what it holds; the sender checks it."""

    async def get_version(self) -> int:
        """The version served (0 before any update); also the core's readiness probe."""


@runtime_checkable
class TrainerBackend(Protocol):
    """The trainer (`molt_trainer_backends`), a driver object owning its ranks. `batch`: [B, T]
    from `collate`; results are 0 where not trainable; calls block (past `trainer.timeout_s`:
    TimeoutError)."""

    def __init__(self, model_path: str, trainer_cfg: TrainerConfig, *, dtype: str, seed: int,
                 num_threads: int, actor_options: dict | None) -> None:
        """Start `trainer_cfg.num_ranks` ranks; `actor_options`: each rank's Ray options."""

    def train(self, batch: dict[str, torch.Tensor], spec: TrainStep) -> dict[str, float]:
        """`trainer.epochs` x `mini_batches` optimizer steps of `spec`; metrics (`loss`, ...)."""

    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                 with_routing: bool = False) -> Any:
        """[B, T]; `with_routing` (MoE): and the [B, T, layers, k] experts used, or None."""

    def trained_logprobs(self) -> torch.Tensor:
        """[B, T] the log-probs the last `train` started from (pre-update)."""

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T] critic values (estimators with `needs_values`)."""

    def ref_logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0
                     ) -> torch.Tensor:
        """[B, T] log-probs of the frozen initial weights (KL terms)."""

    def full_params(self, adapter: bool = False, master: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors by HF name, LoRA merged (`adapter`: its weights only; `master`: fp32)."""

    def push_weights(self, engines: list[Any], version: int) -> dict[str, Any]:
        """Send the weights as `version`; a dead engine raises `weight_sync.WeightSyncError`."""

    def save_checkpoint(self, path: str) -> bool:
        """Write every rank's state under directory `path`; True when a critic was saved."""

    def load_checkpoint(self, path: str, critic: bool) -> None:
        """Restore what `save_checkpoint(path)` wrote (`critic`: what it returned)."""

    def shutdown(self) -> None:
        """Stop the ranks and release their resources (once, at the end of a run)."""


@runtime_checkable
class RolloutScheme(Protocol):
    """When rollouts run and weights move (`molt_rollout_schemes`): `factory(cfg, generator,
    weights, engines)` once per run (a `RolloutGenerator`, a `WeightPusher`, the engine actors:
    `pause`, `resume`). Optional: `refill(n) -> list[list[Trajectory]]`, n more groups for
    `molt_filter_batch` (default `generator.generate`)."""

    version: int        # the weights trained next; checkpoints restore it

    def next_batch(self, step: int) -> list[list[Trajectory]]:
        """The step's complete groups (`rollout.groups_per_step`), at the start of the step."""

    def sync_weights(self, step: int) -> int:
        """After the step's update: `weights.push(version)` when the scheme decides; returns
        `version`."""


class RolloutGenerator(Protocol):
    """What a rollout scheme gets as `generator` (`rollout.pool.PooledGenerator`): fresh groups,
    or those of its pools; every call blocks."""

    counters: dict[str, float]      # the run's counters, logged each step

    def generate(self, num_groups: int) -> list[list[Trajectory]]:
        """`num_groups` fresh complete groups."""

    def start_pool(self, max_groups: int) -> None:
        """From now on keep up to `max_groups` groups running or finished-and-waiting."""

    def take(self, n: int) -> list[list[Trajectory]]:
        """The pool's first `n` finished groups, oldest first."""

    def advance(self, version: int, groups: int, lag: int, split: bool = False) -> None:
        """The deterministic pool: batch j (`groups` groups) starts once `version` >= j - lag is
        on the engines (`split`: its engine calls stop halfway until version j - lag + 1 is)."""

    def drain(self) -> None:
        """The deterministic pool's batch finished or, split, parked at its split."""

    def hold_requests(self) -> None:
        """Engine requests already sent finish; new ones wait for `release_requests`."""

    def release_requests(self) -> None:
        """Undo `hold_requests`."""


class WeightPusher(Protocol):
    """What a rollout scheme pushes the weights with (`rollout.restarts.EngineRestarts`)."""

    def push(self, version: int) -> None:
        """The trainer's weights to every engine as `version`; an engine that died is replaced
        and loaded, and the push redone."""


@runtime_checkable
class Agent(Protocol):
    """Rollouts, many at once on the generator's event loop: await, never block (`molt_agents`:
    `factory(cfg, tokenizer, plugins, **agent.args)`). Optional: `async aclose()`, called when
    the generator closes (to release what it holds on that loop)."""

    async def rollout(self, ctx: RolloutContext) -> Trajectory:
        """A `Trajectory` from `ctx.generate` with its `reward`; raising drops the rollout."""


@runtime_checkable
class Env(Protocol):
    """The `gym` agent's environment (`molt_envs`): one per rollout, from `agent.args.env_args`."""

    async def reset(self, seed: int) -> Observation:
        """Start the episode of task `seed`; return the first observation."""

    async def step(self, action: str) -> tuple[Observation | None, float, bool, dict]:
        """The policy's reply as text -> (observation, reward, done, info)."""


@runtime_checkable
class MetricSink(Protocol):
    """Gets every metrics row besides `metrics.jsonl` (`molt_metric_sinks`: `factory(run_dir,
    cfg)`, one per `log.sinks` name), synchronously in the driver. Optional: `log_completions(step,
    rows)`, each saved step's rollouts as rows {prompt, completion, reward, reference} (text)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The row's numeric entries (`time`, `elapsed_s` too; held-out rows: `eval/...`)."""

    def close(self) -> None:
        """End of the run, also after an error."""

