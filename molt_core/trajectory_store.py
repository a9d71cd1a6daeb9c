"""Saved trajectories: `RUN_DIR/trajectories/step_NNNNNN.parquet`, one row per rollout.

Columns (per-token lists align with `token_ids`): step, group_id, rollout_id, task, reward,
turn_rewards, truncated, token_ids, loss_mask, behavior_logprobs, trainer_logprobs (the trainer's
pre-update log-probs it trained with; empty when not recorded), versions, segments (start of
each), segment_text (decoded), images (placeholder span, grid, `ref`: `images/<ref>.safetensors`
holds the pixel values), info (JSON). Open with pandas/pyarrow directly, or
`molt_tools.view.read_trajectories`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import queue
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import structlog
import torch

from molt_core.trajectory import Trajectory

__all__ = ["TrajectoryWriter", "trajectory_rows", "write_trajectories"]

log = structlog.get_logger("molt.trajectories")
_INT, _F32 = pa.list_(pa.int32()), pa.list_(pa.float32())
SCHEMA = pa.schema([
    ("step", pa.int64()), ("group_id", pa.int64()), ("rollout_id", pa.int64()),
    ("task", pa.int64()), ("reward", pa.float64()), ("turn_rewards", pa.list_(pa.float64())),
    ("truncated", pa.bool_()), ("token_ids", _INT), ("loss_mask", pa.list_(pa.bool_())),
    ("behavior_logprobs", _F32), ("trainer_logprobs", _F32), ("versions", _INT),
    ("segments", _INT), ("segment_text", pa.list_(pa.string())),
    ("images", pa.list_(pa.struct([("start", pa.int32()), ("num_tokens", pa.int32()),
                                   ("grid_thw", _INT), ("ref", pa.string())]))),
    ("info", pa.string())])


def trajectory_rows(step: int, trajs: list[Trajectory], tokenizer: Any,
                    trainer_logprobs: list[list[float]] | None = None,
                    task_of: Callable[[int], int] | None = None,
                    image_dir: Path | None = None) -> list[dict[str, Any]]:
    """Plain rows of `SCHEMA`; images are written once each to `image_dir` (content-addressed)."""
    rows = []
    for i, t in enumerate(trajs):
        bounds = sorted(set(t.segments) | {0}) + [len(t)]
        rows.append({
            "step": step, "group_id": t.group_id, "rollout_id": t.rollout_id,
            "task": task_of(t.group_id) if task_of else -1, "reward": float(t.reward),
            "turn_rewards": t.turn_rewards, "truncated": t.truncated, "token_ids": t.token_ids,
            "loss_mask": t.loss_mask, "behavior_logprobs": t.logprobs,
            "trainer_logprobs": trainer_logprobs[i] if trainer_logprobs else [],
            "versions": t.versions, "segments": bounds[:-1],
            "segment_text": tokenizer.batch_decode([t.token_ids[a:b]
                                                    for a, b in zip(bounds, bounds[1:])]),
            "images": [{"start": im.start, "num_tokens": im.num_tokens, "grid_thw": im.grid_thw,
                        "ref": _save_image(im.pixel_values, image_dir)} for im in t.images],
            "info": json.dumps(t.info, default=str)})
    return rows


def _save_image(pixels: torch.Tensor, image_dir: Path | None) -> str:
    ref = hashlib.sha1(pixels.contiguous().numpy().tobytes()).hexdigest()[:16]
    if image_dir is not None and not (image_dir / f"{ref}.safetensors").exists():
        from safetensors.torch import save_file
        image_dir.mkdir(parents=True, exist_ok=True)
        save_file({"pixel_values": pixels.contiguous()}, str(image_dir / f"{ref}.safetensors"))
    return ref


def write_trajectories(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows of `SCHEMA` to one Parquet file (zstd), atomically (a temporary file renamed)."""
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), f"{path}.tmp", compression="zstd")
    os.replace(f"{path}.tmp", path)


class TrajectoryWriter:
    """Saves what each step trained on from a SCHED_IDLE process (no GIL shared with the loop),
    fed by a thread; a full queue drops a step with a warning rather than stall the loop.
    `every`: steps between saves (0: off); `per_step`: rollouts saved per saved step (0: all)."""

    def __init__(self, run_dir: Path | None, tokenizer: Any, every: int = 1, per_step: int = 0,
                 task_of: Callable[[int], int] | None = None) -> None:
        self.dir = run_dir / "trajectories" if run_dir and every > 0 else None
        self.every, self.task_of, self.queue = every, task_of, queue.Queue(maxsize=64)
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.proc = subprocess.Popen(   # its own session: Ctrl-C stops the loop, not this
                [sys.executable, "-c", _SERVE],
                stdin=subprocess.PIPE, start_new_session=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            threading.Thread(target=self._run, daemon=True, name="molt-trajectories",
                             args=(pickle.dumps((self.dir, tokenizer, per_step)),)).start()

    def write(self, step: int, trajs: list[Trajectory], policy: Any = None) -> None:
        """Queue the step's trajectories with the trainer's log-probs of their rows (one row per
        segment, as `advantage.training_batch` builds them; requested now, fetched later)."""
        if not self.dir or step % self.every:
            return
        lp = policy.trained_logprobs() if hasattr(policy, "trained_logprobs") else None
        try:
            self.queue.put_nowait((step, trajs, lp))
        except queue.Full:
            log.warning("trajectory writer behind: step not saved", step=step)

    def _run(self, setup: bytes) -> None:
        self.proc.stdin.write(setup)
        for step, trajs, lp in iter(self.queue.get, None):
            try:    # MoE routing is not saved (large, slow to pickle)
                trajs = [replace(t, routed_experts=None) if t.routed_experts else t for t in trajs]
                tasks = {t.group_id: self.task_of(t.group_id) for t in trajs if self.task_of}
                pickle.dump((step, trajs, tasks, lp and lp()), self.proc.stdin, protocol=5)
                self.proc.stdin.flush()
            except Exception as e:   # a failed save must not kill the run
                log.warning("trajectory save failed", step=step, error=f"{type(e).__name__}: {e}")
        self.proc.stdin.close()

    def close(self) -> None:
        if self.dir:
            self.queue.put(None)
            self.proc.wait(timeout=600)


# SCHED_IDLE (Linux) before the imports: the writer takes only CPU nobody else wants, from its
# start on (the actors' imports and model builds are still running then)
_SERVE = ("import os\nif hasattr(os, 'sched_setscheduler'): os.sched_setscheduler(0, "
          "os.SCHED_IDLE, os.sched_param(0))\nimport molt_core.trajectory_store as s; s._serve()")


def _serve() -> None:
    """The writer process: (dir, tokenizer, per_step), then one saved step after another."""
    out, tokenizer, per_step = pickle.load(sys.stdin.buffer)
    with contextlib.suppress(EOFError):     # the loop closed its end (or died)
        while True:
            step, trajs, tasks, lp = pickle.load(sys.stdin.buffer)
            try:
                lp = None if lp is None else _per_trajectory(trajs, lp)[:per_step or None]
                write_trajectories(out / f"step_{step:06d}.parquet", trajectory_rows(
                    step, trajs[:per_step or None], tokenizer, lp, tasks and tasks.get,
                    out / "images"))
            except Exception as e:
                log.warning("trajectory save failed", step=step, error=f"{type(e).__name__}: {e}")


def _per_trajectory(trajs: list[Trajectory], lp: torch.Tensor) -> list[list[float]]:
    """[rows, T] per-segment log-probs -> one list per trajectory over all its tokens."""
    rows = iter(lp.tolist())
    return [sum((next(rows)[:len(s)] for s in t.split_segments()), []) for t in trajs]
