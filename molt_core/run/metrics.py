"""Run directory, structlog events, metrics.jsonl and the progress bar."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import structlog
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["RENAMED", "MetricsSink", "RunDirError", "configure_logging", "make_run_dir",
           "namespaced", "resume_hint"]

# old flat name -> namespaced (docs/observability.md); a plugin's other flat `x`: `train/x`
RENAMED = {"loss": "train/loss", "grad_norm": "train/grad_norm", "entropy": "train/entropy",
           "kl": "policy/kl_ref", "clip_fraction": "policy/clip_fraction", "ratio": "policy/ratio",
           "seq_ratio": "policy/seq_ratio", "version": "policy/version",
           "elapsed_s": "time/elapsed_s", "is_weight": "mismatch/is_weight",
           "is_filtered_fraction": "mismatch/is_filtered_fraction",
           "is_truncated_fraction": "mismatch/is_truncated_fraction"}


def namespaced(metrics: dict[str, Any]) -> dict[str, Any]:
    """Every key namespaced, plus the old flat ones as aliases for one release (not for sinks)."""
    flat = {k: v for k, v in metrics.items() if "/" not in k and k not in ("step", "time")}
    return {**metrics, **{RENAMED.get(k, f"train/{k}"): v for k, v in flat.items()}}


def configure_logging(level: str = "INFO", fmt: str = "console") -> None:
    """By the CLI only (never at import): key=value events (`fmt` json: JSON lines) on stderr."""
    json_lines = fmt == "json"
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso" if json_lines else "%H:%M:%S"),
                    structlog.processors.JSONRenderer() if json_lines
                    else structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level)),
        # a logger per call on whatever `sys.stderr` is then (tests and tools swap it)
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, cwd=Path(__file__).parent).stdout.strip() or "-"
    except (OSError, subprocess.TimeoutExpired):
        return "-"


def make_run_dir(out_dir: str, name: str, config: dict, plugins: dict, seed: int,
                 argv: list[str]) -> Path:
    """Create `out_dir/name-YYYYmmdd-HHMMSS` with the resolved config and provenance."""
    run_dir = Path(out_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while run_dir.exists():
        run_dir = run_dir.with_name(f"{run_dir.name.rsplit('.', 1)[0]}.{n}")
        n += 1
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    meta = {"git_sha": _git_sha(), "seed": seed, "argv": argv, "plugins": plugins,
            "python": sys.version.split()[0]}
    (run_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    return run_dir


class MetricsSink:
    """Appends one JSON line per step (`step`: updates done, wall-clock `time`, `elapsed_s`), fans
    it out to the metric sinks (`log.sinks`) and drives a progress bar (off: a log line a step)."""

    def __init__(self, run_dir: Path | None, total_steps: int, show: bool = True,
                 sinks: list[Any] = ()) -> None:
        self.file = (run_dir / "metrics.jsonl").open("a") if run_dir else None
        self.sinks, self.show, self.total, self.t0 = list(sinks), show, total_steps, time.time()
        self.progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 disable=not show, transient=False)
        self.task = self.progress.add_task("train", total=total_steps, info="")
        self.progress.start()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        now = time.time()
        plain = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}
        row = {"step": step, "time": now, **namespaced({"elapsed_s": now - self.t0, **plain})}
        if self.file:
            end = os.fstat(self.file.fileno()).st_size
            try:
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()
            except OSError as e:           # disk full, quota: never leave a partial line
                f, self.file, path = self.file, None, self.file.name
                with contextlib.suppress(OSError):
                    f.close()              # its flush fails again; the descriptor closes anyway
                with contextlib.suppress(OSError):
                    os.truncate(path, end)
                raise RunDirError(f"cannot append step {step} to {path}: {e}. Free space or fix "
                                  f"the run directory, {resume_hint(Path(path).parent)}") from e
        # namespaced only: not the aliases nor the wall-clock `time` (each sink stamps its own,
        # and MLflow's file store cannot hold a metric `time` beside the `time/*` ones)
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and "/" in k}
        for sink in self.sinks:
            sink.log(step, numbers)
        if "reward/mean" not in row and "train/loss" not in row:   # a held-out evaluation row
            structlog.get_logger("molt").info("eval", step=step, **{
                k[5:]: round(v, 4) for k, v in numbers.items() if k.startswith("eval/")})
            return
        what = "reward" if "reward/mean" in row else "loss"     # molt sft: no reward
        reward, step_s = row.get(f"{what}/mean", row.get("train/loss")), row.get("time/step_s", 0)
        if self.show:
            self.progress.update(self.task, completed=step,
                                 info=f"{what} {reward:.3f}  step {step_s:.2f}s")
        else:
            structlog.get_logger("molt").info("step", step=f"{step}/{self.total}",
                                              **{what: round(reward, 4)}, step_s=round(step_s, 3))

    def completions(self, step: int, trajs: list, tokenizer: Any, log: Any) -> None:
        """Sinks with `log_completions(step, rows)`: a saved step's rollouts as TRL's completions
        table (prompt, completion, reward, reference: the `dataset` row's columns as JSON)."""
        sinks = [s for s in self.sinks if hasattr(s, "log_completions")]
        if not (sinks and trajs and log.trajectories_every) or (step - 1) % log.trajectories_every:
            return
        text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)      # noqa: E731
        ref = lambda info: json.dumps(info["columns"], default=str) if "columns" in info else ""
        rows = [{"prompt": text(t.token_ids[:c]), "completion": text(t.token_ids[c:]),
                 "reward": t.reward, "reference": ref(t.info)}
                for t in trajs[:log.trajectories_per_step or None]
                for c in [next((i for i, m in enumerate(t.loss_mask) if m), len(t))]]
        for sink in sinks:
            sink.log_completions(step, rows)

    def note(self, line: str) -> None:
        """Progress between steps on the bar (`eval: 12/64 rollouts`)."""
        self.progress.update(self.task, info=line)

    def close(self) -> None:
        self.progress.stop()
        for sink in self.sinks:
            sink.close()
        if self.file:
            self.file.close()


class RunDirError(OSError):
    """The run directory cannot be written or read (disk full, permissions, a missing file)."""


def resume_hint(run_dir: Path) -> str:
    """How to go on after a write failure: from the latest checkpoint, or afresh without one."""
    done = sorted(run_dir.glob("checkpoints/step_*"))
    return (f"then `molt run --resume {run_dir}` (from {done[-1].name})" if done else
            "then start the run again: it has no checkpoint yet (trainer.save_every)")
