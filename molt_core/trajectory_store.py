"""Saved trajectories: `RUN_DIR/trajectories/step_NNNNNN.parquet`, one row per rollout.

Columns (per-token lists align with `token_ids`): step, group_id, rollout_id, task, reward,
turn_rewards, truncated, token_ids, loss_mask, behavior_logprobs, trainer_logprobs (the trainer's
pre-update log-probs it trained with; empty when not recorded), versions, segments (start of
each), segment_text (decoded), images (placeholder span, grid, `ref`: `images/<ref>.safetensors`
holds the pixel values), info (JSON). Open with pandas/pyarrow directly, or `read_trajectories`.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import structlog
import torch

from molt_core.trajectory import Trajectory

__all__ = ["TrajectoryWriter", "read_trajectories", "trajectory_rows", "write_trajectories"]

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
    buf = pa.BufferOutputStream()     # ~4x faster here than pyarrow's own file output
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), buf, compression="zstd")
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue().to_pybytes())
    tmp.replace(path)


def read_trajectories(path: str | Path, steps: list[int] | None = None) -> list[dict[str, Any]]:
    """Rows (plain dicts) of a run directory, its `trajectories/` folder or one Parquet file."""
    path = Path(path)
    if path.is_dir() and (path / "trajectories").is_dir():
        path = path / "trajectories"
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    return [r for r in rows if steps is None or r["step"] in steps]


class TrajectoryWriter:
    """Saves what each step trained on, from a background thread (a full queue drops a step
    with a warning rather than stall the loop). `every`: steps between saves (0: off);
    `per_step`: rollouts saved per saved step (0: all)."""

    def __init__(self, run_dir: Path | None, tokenizer: Any, every: int = 1, per_step: int = 0,
                 task_of: Callable[[int], int] | None = None) -> None:
        self.dir = run_dir / "trajectories" if run_dir and every > 0 else None
        self.tokenizer, self.every, self.per_step = tokenizer, every, per_step
        self.task_of = task_of
        self.queue: queue.Queue = queue.Queue(maxsize=16)
        self.thread = threading.Thread(target=self._run, daemon=True, name="molt-trajectories")
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.thread.start()

    def write(self, step: int, trajs: list[Trajectory], policy: Any = None) -> None:
        """Queue the step's trajectories with the trainer's log-probs of their rows (one row per
        segment, in order, as `advantage.training_batch` builds them)."""
        if not self.dir or step % self.every:
            return
        lp = getattr(policy, "trained_logprobs", None)
        lp = lp() if lp else None             # requested now, fetched by the writer thread
        try:
            self.queue.put_nowait((step, trajs, lp))
        except queue.Full:
            log.warning("trajectory writer behind: step not saved", step=step)

    def _run(self) -> None:
        if sys.platform == "linux":    # a thread is a task there: only this one gets idle CPU
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while (item := self.queue.get()) is not None:
            step, trajs, lp = item
            try:
                per_traj = _per_trajectory(trajs, lp()) if lp is not None else None
                keep = range(min(self.per_step, len(trajs)) if self.per_step else len(trajs))
                rows = trajectory_rows(step, [trajs[i] for i in keep], self.tokenizer,
                                       per_traj and [per_traj[i] for i in keep], self.task_of,
                                       self.dir / "images")
                write_trajectories(self.dir / f"step_{step:06d}.parquet", rows)
            except Exception as e:   # a failed save must not kill the run
                log.warning("trajectory save failed", step=step, error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()


def _per_trajectory(trajs: list[Trajectory], lp: torch.Tensor) -> list[list[float]]:
    """[rows, T] per-segment log-probs -> one list per trajectory over all its tokens."""
    out, row = [], 0
    for t in trajs:
        parts = []
        for s in t.split_segments():
            parts += lp[row, :len(s)].tolist()
            row += 1
        out.append(parts)
    return out
