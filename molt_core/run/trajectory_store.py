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
STARVED_S = 10.0    # a flush the writer has not done in this long: the driver does it
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
    try:
        pq.write_table(pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(zip(*rows),
                       SCHEMA)], schema=SCHEMA), f"{path}.tmp", compression="zstd")
        os.replace(f"{path}.tmp", path)
    except OSError:
        Path(f"{path}.tmp").unlink(missing_ok=True)
        raise


class TrajectoryWriter:
    """Saves what each step trained on from a SCHED_IDLE process (no GIL shared with the loop),
    fed by a thread (a full queue drops a step, warned); a checkpoint waits for `flush`, so each
    step is saved once across a kill and resume; a failed writer stops the run (`RunDirError`),
    a starved one (`STARVED_S`) is ended and the driver saves its steps (`sent`: not yet on disk).
    `start`: this run's first step (a resumed run's saved steps from it on replace any)."""

    def __init__(self, run_dir: Path | None, tokenizer: Any, every: int = 1, per_step: int = 0,
                 task_of: Callable[[int], int] | None = None, start: int = 0) -> None:
        self.dir = run_dir / "trajectories" if run_dir and every > 0 else None
        self.every, self.per_step, self.task_of = every, per_step or None, task_of
        self.why, self.sent, self.tok = "", [], tokenizer   # its failure; steps not yet on disk
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._spawn(start)

    def _spawn(self, start: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=64)
        self.proc = subprocess.Popen(   # its own session: Ctrl-C stops the loop, not this
            [sys.executable, "-c", _SERVE],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        threading.Thread(target=self._run, daemon=True, name="molt-trajectories", args=(
            self.proc, self.queue, pickle.dumps((self.dir, self.tok, start)))).start()

    def write(self, step: int, trajs: list[Trajectory], policy: Any = None) -> None:
        """Queue the step's trajectories with the trainer's log-probs of their rows (one row per
        segment, as `advantage.training_batch` builds them)."""
        if not self.dir or (step - 1) % self.every:      # steps 1, 1 + every, ...
            return
        if self.why or self.proc.poll() is not None:
            self._failed()
        self._heard(0.0)
        lp = policy.trained_logprobs().numpy() if hasattr(policy, "trained_logprobs") else None
        try:
            self.queue.put_nowait(item := (step, trajs[:self.per_step], lp))
            self.sent.append(item)
        except queue.Full:
            log.warning("trajectory writer behind: step not saved", step=step)

    def _run(self, proc: subprocess.Popen, q: queue.Queue, setup: bytes) -> None:
        proc.stdin.write(setup)
        for item in iter(q.get, None):
            try:    # MoE routing is not saved (large, slow to pickle)
                if item != "flush":
                    step, trajs, lp = item
                    trajs = [replace(t, routed_experts=None) for t in trajs]
                    tasks = {t.group_id: self.task_of(t.group_id) for t in trajs if self.task_of}
                    item = (step, trajs, tasks, lp)
                pickle.dump(item, proc.stdin, protocol=5)
                proc.stdin.flush()
            except BrokenPipeError:     # it died or was ended: `flush` and `write` say why
                return
            except Exception as e:   # a failed save must not kill the run
                log.warning("trajectory save failed", step=step, error=f"{type(e).__name__}: {e}")

    def _heard(self, timeout: float) -> bool:
        """The writer's word within `timeout` s: a step (on disk up to it), "ok" (flushed: True)."""
        end, said = time.monotonic() + timeout, self.proc.stdout.raw   # unbuffered: for select
        while select.select([said], [], [], max(end - time.monotonic(), 0.0))[0]:
            if (line := said.readline()) == b"ok\n":
                self.sent = []
                return True
            if not line[:-1].isdigit():     # its last word: an error (none: it died)
                self._failed(line)
            self.sent = [s for s in self.sent if s[0] > int(line)]
        return False

    def flush(self, respawn: bool = True) -> None:
        """Wait until every step queued so far is on disk (meanwhile the writer not idle, where
        the OS allows); past `STARVED_S` the driver saves them (`respawn`: a new writer goes on)."""
        if self.dir and self.sent:
            with contextlib.suppress(queue.Full):       # full: that far behind, it is starved
                self.queue.put_nowait("flush")
            self._priority("OTHER")
            if not self._heard(STARVED_S) and self.sent:    # (empty: its flush was not queued)
                self._end()
                (first, *_), (last, *_) = self.sent[0], self.sent[-1]
                os.close(_claim(self.dir, first))       # what it saved from `first` on goes
                try:
                    write_trajectories(self.dir / f"step_{first:06d}.parquet", [
                        r for step, trajs, lp in self.sent for r in trajectory_rows(
                            step, trajs, self.tok, lp, self.task_of, self.dir / "images")])
                except OSError as e:                    # as the writer would say it
                    self._failed(f"{type(e).__name__}: {e} ({shutil.disk_usage(self.dir).free} "
                                 "bytes free)".encode())
                log.warning("trajectory writer starved (the machine is busy): the run saved its "
                            "steps itself", steps=f"{first}-{last}", dir=str(self.dir))
                self.sent = []
                if respawn:
                    self._spawn(last + 1)
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

    def _end(self) -> None:
        self.proc.kill()            # all it held is on disk or in `sent`
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def close(self) -> None:
        """The last steps on disk (`flush`), then the writer ends: exit never waits on it."""
        if self.dir:
            try:
                if not self.why:
                    self.flush(respawn=False)
            except OSError as e:        # a full disk: said; the run's own error goes on
                log.error("trajectory writer failed", error=str(e))
            finally:
                self._end()


# SCHED_IDLE (Linux) before the imports: only CPU nobody else wants, from the start (the actors
# still build then). No garbage collector: nothing here makes cycles; it would rescan every row.
_SERVE = ("import gc, os; gc.disable()\nif hasattr(os, 'SCHED_IDLE'): os.sched_setscheduler(0, "
          "os.SCHED_IDLE, os.sched_param(0))\nimport molt_core.run.trajectory_store as s; s._serve()")


def _serve() -> None:
    """The writer process: (dir, tokenizer, start), then one saved step after another; a file
    per `FLUSH_S` seconds of them, one per "flush", one when the loop closes its end (or dies).
    Said on stdout: each file's last step, "ok" per flush, an OSError (disk full) as last word."""
    ack, (out, tokenizer, start) = os.fdopen(os.dup(1), "w"), pickle.load(sys.stdin.buffer)
    os.dup2(2, 1)                               # prints and logs: not on the acknowledgements
    try:
        _write_loop(out, tokenizer, start, ack)
        os._exit(0)         # all written: no interpreter teardown (seconds of CPU at idle priority)
    except OSError as e:
        _say(ack, f"{type(e).__name__}: {e} ({shutil.disk_usage(out).free} bytes free)")
        os._exit(1)


def _claim(out: Path, start: int) -> int:
    """The dir locked (an orphaned earlier writer ends first), its steps from `start` on gone."""
    fcntl.flock(lock := os.open(out, os.O_RDONLY), fcntl.LOCK_EX)
    for f in out.glob("*.parquet"):
        keep = pq.read_table(f, filters=[("step", "<", start)])
        if not keep.num_rows:
            f.unlink()
        elif keep.num_rows < pq.read_metadata(f).num_rows:     # atomically, as every file
            pq.write_table(keep, f"{f}.tmp", compression="zstd")
            os.replace(f"{f}.tmp", f)
    return lock


def _say(ack: Any, word: str) -> None:
    with contextlib.suppress(BrokenPipeError):     # its driver gone: it saves on all the same
        ack.write(word)
        ack.flush()


def _write_loop(out: Path, tokenizer: Any, start: int, ack: Any) -> None:
    _claim(out, start)              # held while it lives: an earlier run's steps from start go
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
            _say(ack, f"{rows[-1][0]}\n")            # on disk up to that step
            rows, flushed = [], time.monotonic()
        if item == "flush":
            _say(ack, "ok\n")
            item = None
