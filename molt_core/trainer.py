"""THE training loop: generate, filter, advantages, train, sync weights, eval, log, checkpoint."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import structlog
import torch
from transformers import AutoConfig

from molt_core import multimodal
from molt_core.advantage import opt_in, training_batch
from molt_core.config import Config
from molt_core.consistency import check_consistency, probe_consistency
from molt_core.plugins import Plugins
from molt_core.policy.objective import TrainStep
from molt_core.rollout.eval import eval_agent, eval_due, evaluate
from molt_core.rollout.generator import version_lag_metrics
from molt_core.rollout.pool import PooledGenerator
from molt_core.rollout.restarts import EngineRestarts
from molt_core.run import cluster
from molt_core.run.checkpoint import Checkpointer
from molt_core.run.metrics import MetricsSink, namespaced
from molt_core.run.trajectory_store import TrajectoryWriter
from molt_core.trajectory import Trajectory

__all__ = ["prepare", "train"]


def train(cfg: Config, plugins: Plugins, run_dir: Path | None = None, progress: bool = True,
          resume: Path | None = None, prepared: tuple | None = None) -> list[dict[str, Any]]:
    """`cfg.trainer.steps` steps (from checkpoint `resume` on), step k the k-th update (rows,
    files, hooks: `step` k); `prepared`: what `prepare` returned (else it runs here)."""
    tokenizer, vocab_size, agent = prepared or prepare(cfg, plugins)
    torch.manual_seed(cfg.seed)
    with cluster.start(cfg, plugins) as (policy, engines):
        generator = PooledGenerator(agent, engines, cfg, tokenizer, vocab_size)
        weights = EngineRestarts(cfg, plugins, generator, policy)   # replaces engines that die
        scheme = plugins.get("rollout_scheme", cfg.rollout.scheme)(cfg, generator, weights,
                                                                   engines)
        ckpt = Checkpointer(cfg, run_dir, policy, engines, generator, scheme, plugins)
        start, version = ckpt.restore(resume)    # version: the weights being trained
        if version:                              # resumed: the engines serve them too
            weights.push(version)
        sink = MetricsSink(run_dir, cfg.trainer.steps, progress,
                           [plugins.get("metric_sink", s)(run_dir, cfg) for s in cfg.log.sinks])
        saved = TrajectoryWriter(run_dir, tokenizer, cfg.log.trajectories_every,
                                 cfg.log.trajectories_per_step, generator.task_of, start + 1)
        ckpt.flush = saved.flush
        log = _Log(cfg, plugins, sink, partial(evaluate, cfg, plugins, engines, tokenizer,
                                                vocab_size, run_dir=run_dir))
        dead = _DeadRun(cfg.trainer.dead_run_steps)
        try:
            for step in range(start + 1, cfg.trainer.steps + 1):
                log.held_out(step - 1)          # the weights of step - 1 updates (0: initial)
                t0, times = time.perf_counter(), {}
                with _timed(times, "time/generate_s"):
                    groups = scheme.next_batch(step)
                groups = filter_batch(plugins, groups, step,   # refill: for DAPO-style filters
                                      getattr(scheme, "refill", generator.generate))
                dead(step, [t for g in groups for t in g])
                if not groups:          # the filters kept nothing: no update this step, counted
                    generator.counters["trainer/empty_batches"] += 1
                    log(step, {"version": version, **generator.counters})
                    continue
                trajs = [t for g in groups for t in g]
                batch, adv, adv_metrics = training_batch(
                    trajs, plugins.get("estimator", cfg.algorithm.estimator), cfg.algorithm,
                    policy, cfg.sampling.temperature, tokenizer.pad_token_id or 0)
                with _timed(times, "time/train_s"):
                    metrics = policy.train(batch, train_step(cfg, plugins, step - 1, version))
                metrics.update(rollout_metrics(trajs, adv, version), **adv_metrics)
                with _timed(times, "time/weight_sync_s"):     # the push, then its canary
                    version = scheme.sync_weights(step)
                    weights.check_canary(version)
                saved.write(step, trajs, policy)
                sink.completions(step, trajs, tokenizer, cfg.log)
                check_consistency(cfg, step, metrics, lambda: probe_consistency(
                    generator, policy, version, cfg.sampling.temperature))
                log(step, {**metrics, **generator.counters, "version": version, **times,
                           "time/engine_busy_s": generator.client.busy_s(),
                           "time/step_s": time.perf_counter() - t0})
                if ckpt.step_end(step - 1, version):     # SIGINT/SIGTERM: saved; stop
                    return log.history
            log.held_out(cfg.trainer.steps)
        finally:
            ckpt.close()
            sink.close()
            saved.close()
            generator.close()
    return log.history


def prepare(cfg: Config, plugins: Plugins) -> tuple[Any, int, Any]:
    """Tokenizer, vocabulary size and agent, and every check `train` makes before it starts a
    process (`molt validate` runs it: one refuses what the other would; `ray.address`: at start)."""
    tokenizer = multimodal.load_tokenizer(cfg.model.path, cfg.model.chat_template)
    vocab_size = AutoConfig.from_pretrained(cfg.model.path).get_text_config().vocab_size
    agent = plugins.get("agent", cfg.agent.name)(cfg, tokenizer, plugins, **cfg.agent.args)
    if cfg.eval.every:
        eval_agent(cfg, plugins, tokenizer)
    if not cfg.ray.address:         # the local node, as cluster.start will see it
        node = cluster.local_node(cfg)
        cluster.check_resources(cfg, *cluster.actor_options(cfg, node[0]["GPU"] > 0), node)
    return tokenizer, vocab_size, agent


def train_step(cfg: Config, plugins: Plugins, step: int, version: int) -> TrainStep:
    """One batch's update: the loss, its arguments (`step`: the updates before it), the terms."""
    alg = cfg.algorithm
    loss_fn = plugins.get("loss", alg.loss)
    return TrainStep(loss_fn, {**alg.loss_args, **opt_in(loss_fn, step=step)}, alg.loss_agg,
                     cfg.sampling.temperature, alg.correction, alg.correction_args, version,
                     asdict(alg.terms))


@contextmanager
def _timed(times: dict[str, float], key: str) -> Iterator[None]:
    t = time.perf_counter()
    yield
    times[key] = time.perf_counter() - t


class _Log:
    """Where rows go: `molt_on_step_end`, the metric sinks, the returned `history`; with
    `eval.every`, held-out evaluation rows ({"step": updates so far, "eval/...": ...}): 0..N."""

    def __init__(self, cfg: Config, plugins: Plugins, sink: MetricsSink,
                 evaluate: Callable[..., dict[str, float]]) -> None:
        self.cfg, self.plugins, self.sink, self.evaluate = cfg, plugins, sink, evaluate
        self.history: list[dict[str, Any]] = []

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        metrics = namespaced(metrics)
        self.plugins.hook.molt_on_step_end(step=step, metrics=metrics)
        self.sink.log(step, metrics)
        self.history.append(metrics)

    def held_out(self, step: int) -> None:    # its own row: the weights after `step` updates
        if eval_due(self.cfg, step):
            row = self.evaluate(progress=self.sink.note, step=step)
            self.sink.log(step, row)
            self.history.append({"step": step, **row})


class _DeadRun:
    """Says once that `n` steps in a row had no learning signal: every group flat (one reward for
    all its rollouts) or no trainable token, or nothing left after the filters (0: never)."""

    def __init__(self, n: int) -> None:
        self.n, self.run = n, 0

    def __call__(self, step: int, trajs: list[Trajectory]) -> None:
        groups: dict[int, set[float]] = {}
        for t in trajs:
            groups.setdefault(t.group_id, set()).add(t.reward)
        flat = all(len(g) == 1 for g in groups.values()) or not any(t.num_trainable for t in trajs)
        self.run = self.run + 1 if flat else 0
        if self.run == self.n:
            self.n = 0
            mean = sum(t.reward for t in trajs) / max(len(trajs), 1)
            structlog.get_logger("molt").warning(
                f"no learning signal for {self.run} steps in a row (to step {step}; "
                "trainer.dead_run_steps): every group's rollouts got one reward (mean "
                f"{mean:.3f}) or had no trainable token, so group-relative advantages are 0 and "
                "the reward teaches nothing (such steps are skipped: train/no_signal_steps). "
                "This policy never (or always) solves the task: cold-start it with SFT on "
                "demonstrations (`molt sft`), give easier tasks or a reward with partial credit, "
                "or more spread (sampling.temperature, rollout.group_size); `molt rollout RECIPE "
                "-n 32` shows the base rate")


def filter_batch(plugins: Plugins, groups: list, step: int, refill: Any) -> list:
    """Each `molt_filter_batch` in turn (registration order); None leaves the groups as they are,
    a list (also []) replaces them."""
    for impl in reversed(plugins.hook.molt_filter_batch.get_hookimpls()):
        kw = {"groups": groups, "step": step, "refill": refill}
        out = impl.function(**{k: kw[k] for k in impl.argnames})
        groups = groups if out is None else out
    return groups


def rollout_metrics(trajs: list[Trajectory], adv: torch.Tensor, version: int = 0
                    ) -> dict[str, float]:
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    lens = torch.tensor([t.num_trainable for t in trajs], dtype=torch.float32)
    groups: dict[int, list[float]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t.reward)
    flat = sum(max(g) == min(g) for g in groups.values()) / max(len(groups), 1)
    return {**version_lag_metrics(trajs, version), "reward/mean": rewards.mean().item(),
            "reward/max": rewards.max().item(), "reward/min": rewards.min().item(),
            "reward/std": rewards.std(unbiased=False).item(), "reward/zero_std_groups": flat,
            "adv/abs_mean": adv.abs().mean().item(), "response/len_mean": lens.mean().item(),
            "response/truncated": sum(t.truncated for t in trajs) / len(trajs),
            "rollout/trajectories": len(trajs)}
