"""Saved trajectories: `RUN_DIR/trajectories/step_NNNNNN.parquet`, the steps saved within `FLUSH_S`
seconds from step NNNNNN on, one `SCHEMA` row per rollout (docs/observability.md, "Trajectories";
trainer_logprobs: empty when not recorded)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pickle
import queue
import select
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import structlog
import torch

from molt_core.run.metrics import RunDirError, resume_hint
from molt_core.trajectory import Trajectory

__all__ = ["TrajectoryWriter", "trajectory_rows", "write_trajectories"]

log = structlog.get_logger("molt.trajectories")
FLUSH_S = 10.0      # Parquet's cost per file is mostly fixed: one per this many seconds of steps
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
_json = json.JSONEncoder(default=str).encode


def trajectory_rows(step: int, trajs: list[Trajectory], tokenizer: Any, trainer_lp: Any = None,
                    task_of: Callable[[int], int] | None = None, image_dir: Path | None = None
                    ) -> list[tuple]:
    """Rows of `SCHEMA`; `trainer_lp`: [segment rows, T] as trained (`Policy.trained_logprobs`;
    later rows unused); images are written once each to `image_dir` (content-addressed)."""
    starts = [sorted(set(t.segments) | {0}) for t in trajs]
    seqs = [t.token_ids[a:b] for s, t in zip(starts, trajs) for a, b in zip(s, s[1:] + [len(t)])]
    fast = getattr(tokenizer, "backend_tokenizer", None)    # its own decode: the same, 4x quicker
    texts = iter([fast.decode(s, skip_special_tokens=False) for s in seqs] if fast and not
                 tokenizer.clean_up_tokenization_spaces else tokenizer.batch_decode(seqs))
    lp: list = [[]] * len(trajs)
    if trainer_lp is not None:      # one row per non-empty segment, as training_batch
        lp, n = np.asarray(trainer_lp), np.array([len(s) for s in seqs if s])
        lp = lp[:len(n)][np.arange(lp.shape[1]) < n[:, None]]
        lp = np.split(lp, np.cumsum([len(t) for t in trajs])[:-1])
    return [(step, t.group_id, t.rollout_id, task_of(t.group_id) if task_of else -1,
             float(t.reward), t.turn_rewards, t.truncated, t.token_ids, t.loss_mask, t.logprobs, l,
             t.versions, s, [next(texts) for _ in s],
             [{"start": im.start, "num_tokens": im.num_tokens, "grid_thw": im.grid_thw,
               "ref": _save_image(im.pixel_values, image_dir)} for im in t.images], _json(t.info))
            for t, s, l in zip(trajs, starts, lp)]


def _save_image(pixels: torch.Tensor, image_dir: Path | None) -> str:
    ref = hashlib.sha1(pixels.contiguous().numpy().tobytes()).hexdigest()[:16]
    if image_dir is not None and not (image_dir / f"{ref}.safetensors").exists():
        from safetensors.torch import save_file
        image_dir.mkdir(parents=True, exist_ok=True)
        save_file({"pixel_values": pixels.contiguous()}, str(image_dir / f"{ref}.safetensors"))
    return ref


def write_trajectories(path: Path, rows: list[tuple]) -> None:
    """Write rows of `SCHEMA` to one Parquet file (zstd), atomically (a temporary file renamed)."""
    pq.write_table(pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(zip(*rows), SCHEMA)],
                                        schema=SCHEMA), f"{path}.tmp", compression="zstd")
    os.replace(f"{path}.tmp", path)


class TrajectoryWriter:
    """Saves what each step trained on from a SCHED_IDLE process (no GIL shared with the loop),
    fed by a thread (a full queue drops a step, warned); a checkpoint waits for `flush`, so each
    step is saved once across a kill and resume; a failed writer stops the run (`RunDirError`).
    `start`: this run's first step (a resumed run's saved steps from it on replace any)."""

    def __init__(self, run_dir: Path | None, tokenizer: Any, every: int = 1, per_step: int = 0,
                 task_of: Callable[[int], int] | None = None, start: int = 0) -> None:
        self.dir = run_dir / "trajectories" if run_dir and every > 0 else None
        self.every, self.per_step, self.task_of = every, per_step or None, task_of
        self.queue: queue.Queue = queue.Queue(maxsize=64)
        self.why = ""               # the writer's failure
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.proc = subprocess.Popen(   # its own session: Ctrl-C stops the loop, not this
                [sys.executable, "-c", _SERVE],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            threading.Thread(target=self._run, daemon=True, name="molt-trajectories",
                             args=(pickle.dumps((self.dir, tokenizer, start)),)).start()

    def write(self, step: int, trajs: list[Trajectory], policy: Any = None) -> None:
        """Queue the step's trajectories with the trainer's log-probs of their rows (one row per
        segment, as `advantage.training_batch` builds them)."""
        if not self.dir or (step - 1) % self.every:      # steps 1, 1 + every, ...
            return
        if self.why or self.proc.poll() is not None:
            self._failed()
        lp = policy.trained_logprobs().numpy() if hasattr(policy, "trained_logprobs") else None
        try:
            self.queue.put_nowait((step, trajs[:self.per_step], lp))
        except queue.Full:
            log.warning("trajectory writer behind: step not saved", step=step)

    def _run(self, setup: bytes) -> None:
        self.proc.stdin.write(setup)
        for item in iter(self.queue.get, None):
            try:    # MoE routing is not saved (large, slow to pickle)
                if item != "flush":
                    step, trajs, lp = item
                    trajs = [replace(t, routed_experts=None) for t in trajs]
                    tasks = {t.group_id: self.task_of(t.group_id) for t in trajs if self.task_of}
                    item = (step, trajs, tasks, lp)
                pickle.dump(item, self.proc.stdin, protocol=5)
                self.proc.stdin.flush()
            except BrokenPipeError:     # the writer died: `write` and `flush` say why
                return
            except Exception as e:   # a failed save must not kill the run
                log.warning("trajectory save failed", step=step, error=f"{type(e).__name__}: {e}")
        self.proc.stdin.close()

    def flush(self, timeout: float = 600.0) -> None:
        """Wait until every step queued so far is on disk (meanwhile the writer not idle)."""
        if self.dir:
            self.queue.put("flush", timeout=timeout)
            self._priority("OTHER")
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                raise RunDirError(f"the trajectory writer saved nothing within {timeout}s: is "
                                  f"the disk of {self.dir} stalled (or the CPU busy)?")
            if (line := self.proc.stdout.readline()) != b"ok\n":
                self._failed(line)
            self._priority("IDLE")

    def _priority(self, policy: str) -> None:
        """Every writer thread to SCHED_`policy` (leaving IDLE needs root or RLIMIT_NICE)."""
        with contextlib.suppress(OSError, AttributeError):      # AttributeError: not Linux
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                os.sched_setscheduler(int(tid), getattr(os, f"SCHED_{policy}"), os.sched_param(0))

    def _failed(self, line: bytes = b"") -> None:
        self.why = self.why or (line + self.proc.stdout.read()).decode().strip() or (
            f"writer exit code {self.proc.wait(60)}")
        raise RunDirError(f"cannot save trajectories to {self.dir}: {self.why}. The steps saved "
                          "so far are kept; free space (or set log.trajectories_every=0), "
                          f"{resume_hint(self.dir.parent)}")

    def close(self, timeout: float = 60.0) -> None:
        """The last steps saved; past `timeout` (starved) the writer finishes them on its own."""
        if self.dir:
            self.queue.put(None)
            self._priority("OTHER")
            try:
                if self.proc.wait(timeout=timeout) and not self.why:
                    log.error("trajectory writer failed", error=self.proc.stdout.read().decode())
            except subprocess.TimeoutExpired:
                log.warning("trajectory writer still saving: it ends after us", pid=self.proc.pid)


# SCHED_IDLE (Linux) before the imports: only CPU nobody else wants, from the start (the actors
# still build then). No garbage collector: nothing here makes cycles; it would rescan every row.
_SERVE = ("import gc, os; gc.disable()\nif hasattr(os, 'SCHED_IDLE'): os.sched_setscheduler(0, "
          "os.SCHED_IDLE, os.sched_param(0))\nimport molt_core.run.trajectory_store as s; s._serve()")


def _serve() -> None:
    """The writer process: (dir, tokenizer, start), then one saved step after another; a file
    per `FLUSH_S` seconds of them, one per "flush" (acknowledged on stdout), and one when the
    loop closes its end (or dies). An OSError (disk full) is its last word on stdout."""
    ack, (out, tokenizer, start) = os.fdopen(os.dup(1), "w"), pickle.load(sys.stdin.buffer)
    os.dup2(2, 1)                               # prints and logs: not on the acknowledgements
    try:
        _write_loop(out, tokenizer, start, ack)
        os._exit(0)         # all written: no interpreter teardown (seconds of CPU at idle priority)
    except OSError as e:
        for f in out.glob("*.tmp"):
            f.unlink()
        ack.write(f"{type(e).__name__}: {e} ({shutil.disk_usage(out).free} bytes free)")
        ack.flush()
        sys.exit(1)


def _write_loop(out: Path, tokenizer: Any, start: int, ack: Any) -> None:
    # an earlier writer of this dir (its driver killed) ends, its last steps written, first
    fcntl.flock(os.open(out, os.O_RDONLY), fcntl.LOCK_EX)
    for f in out.glob("*.parquet"):         # an earlier run's steps from `start` on go
        keep = pq.read_table(f, filters=[("step", "<", start)])
        if not keep.num_rows:
            f.unlink()
        elif keep.num_rows < pq.read_metadata(f).num_rows:     # atomically, as every file
            pq.write_table(keep, f"{f}.tmp", compression="zstd")
            os.replace(f"{f}.tmp", f)
    rows, flushed, step, item = [], time.monotonic(), 0, None
    while step is not None:
        try:
            item = pickle.load(sys.stdin.buffer)
            if item != "flush":
                step, trajs, tasks, lp = item
                rows += trajectory_rows(step, trajs, tokenizer, lp, tasks and tasks.get,
                                        out / "images")
        except (EOFError, pickle.UnpicklingError):      # closed; a dead loop's: maybe mid-step
            step = None
        except OSError:
            raise
        except Exception as e:
            log.warning("trajectory save failed", step=step, error=f"{type(e).__name__}: {e}")
        if rows and (step is None or item == "flush" or time.monotonic() - flushed >= FLUSH_S):
            write_trajectories(out / f"step_{rows[0][0]:06d}.parquet", rows)
            rows, flushed = [], time.monotonic()
        if item == "flush":
            ack.write("ok\n")
            ack.flush()
            item = None
