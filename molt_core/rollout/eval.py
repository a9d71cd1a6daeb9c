"""Held-out evaluation (docs/observability.md, "Held-out evaluation"): a loop of its own over the
generator, the agent and the engines; greedy and sampled passes over tasks `EVAL_TASKS + i`."""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch

from molt_core.config import Config, ConfigError
from molt_core.rollout.generator import Generator

__all__ = ["EVAL_TASKS", "eval_agent", "eval_due", "evaluate", "info_means"]

EVAL_TASKS = 2**48
GREEDY = {"temperature": 1.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}


def _merge(base: dict, over: dict) -> dict:
    return base | {k: _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict)
                   else v for k, v in over.items()}


def info_means(trajs: list, prefix: str) -> dict[str, float]:
    """`prefix + key`: the mean of each number (or bool) in the rollouts' `info` over those that
    hold it (the agent's tool calls, format, ...); row/line numbers are not scores."""
    seen: dict[str, list[float]] = {}
    for t in trajs:
        for k, v in t.info.items():
            if isinstance(v, (bool, int, float)) and k not in ("row", "line"):
                seen.setdefault(k, []).append(float(v))
    return {f"{prefix}{k}": sum(v) / len(v) for k, v in sorted(seen.items())}


def eval_due(cfg: Config, step: int) -> bool:
    """Before step `step` (0 too) every `eval.every` steps, and at `step == trainer.steps` (end)."""
    return bool(every := cfg.eval.every) and (step % every == 0 or step == cfg.trainer.steps)


def eval_agent(cfg: Config, plugins: Any, tokenizer: Any) -> Any:
    """The agent on `eval.agent_args`; one that cannot tell held-out tasks from training's (no
    `held_out` attribute true), or whose `split_args` (the args that decide its split, by dotted
    name) differ from the training agent's, is refused: evaluating it would measure the training
    set."""
    make = plugins.get("agent", cfg.agent.name)
    agent = make(cfg, tokenizer, plugins, **_merge(cfg.agent.args, cfg.eval.agent_args))
    if not getattr(agent, "held_out", False):
        env = cfg.agent.args.get("env")
        raise ConfigError(
            f"eval: agent '{cfg.agent.name}'{f' env {env!r}' if env else ''} serves no held-out "
            "split, so its eval tasks would be training tasks. Select a held-out split: "
            "eval.agent_args={env_args: {split: test}} (gym envs with a split: dataset, whose "
            "test rows are its 'split' column's or env_args.test_fraction of them; math, "
            "arithmetic), {agent_args: {split: test}} (chat agents), or set eval.every=0")
    trained = getattr(make(cfg, tokenizer, plugins, **cfg.agent.args), "split_args", {})
    for key, value in getattr(agent, "split_args", {}).items():
        if key in trained and value != trained[key]:
            raise ConfigError(
                f"eval.agent_args.{key}={value!r} differs from training's {trained[key]!r}: it "
                "decides which tasks are held out, so eval would score training tasks. Set it in "
                f"agent.args.{key} (training and eval share it) and not in eval.agent_args")
    return agent


def evaluate(cfg: Config, plugins: Any, engines: list[Any], tokenizer: Any, vocab_size: int,
             progress: Callable[[str], None] = lambda line: None, run_dir: Path | None = None,
             step: int = 0) -> dict[str, float]:
    """The held-out prompts on the engines' weights: `eval/*` with `eval/<pass>/info/<key>`
    (`info_means`); `progress`: "eval: 3/64 rollouts". With `run_dir` (and trajectories saved:
    `log.trajectories_every`) the rollouts go to `trajectories/eval/step_NNNNNN.parquet` (`step`:
    updates so far; info `eval`: the pass), which `molt view RUN_DIR --eval` shows."""
    t0 = time.perf_counter()
    e, agent = cfg.eval, eval_agent(cfg, plugins, tokenizer)
    out: dict[str, float] = {}
    done, total, saved = [0], e.prompts * (1 + max(e.k, 0)), []

    def group_done(trajs: list) -> None:
        done[0] += len(trajs)
        progress(f"eval: {done[0]}/{total} rollouts")
    for name, knobs, k in (("greedy", GREEDY, 1), ("sampled", {}, e.k)):
        if k < 1:
            continue
        c = copy.deepcopy(cfg)
        c.rollout.group_size, c.sampling = k, dataclasses.replace(cfg.sampling, **knobs)
        gen = Generator(agent, engines, c, tokenizer, vocab_size, lambda g: EVAL_TASKS + g, True)
        gen.on_group_done = group_done
        try:
            groups = gen.generate(e.prompts)
        finally:
            gen.close()
        rewards = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float32)
        solved = (rewards >= e.success).float()
        out[f"eval/{name}/pass@1"] = solved.mean().item()
        out[f"eval/{name}/reward_mean"] = rewards.mean().item()
        if k > 1:
            out[f"eval/{name}/pass@{k}"] = solved.amax(1).mean().item()
        trajs = [t for g in groups for t in g]
        out.update(info_means(trajs, f"eval/{name}/info/"))
        saved += [dataclasses.replace(t, info={**t.info, "eval": name}) for t in trajs]
    if run_dir and cfg.log.trajectories_every and saved:
        from molt_core.run.trajectory_store import trajectory_rows, write_trajectories
        (d := run_dir / "trajectories" / "eval").mkdir(parents=True, exist_ok=True)
        write_trajectories(d / f"step_{step:06d}.parquet", trajectory_rows(
            step, saved, tokenizer, task_of=lambda g: EVAL_TASKS + g, image_dir=d.parent / "images"))
    out["eval/time_s"] = time.perf_counter() - t0
    return out
