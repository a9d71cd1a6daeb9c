"""Saved trajectories read back equal to what the trainer trained on: real `train` runs (Ray,
HF engine, FSDP2 trainer) for a gym, a multi-segment chat and a VL recipe."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

from molt_core import hookimpl
from molt_core.cli import load
from molt_core.trainer import train
from molt_tools.view import read_trajectories
from disk import fill, tmpfs
from test_chat_server import THINK_TEMPLATE   # earlier turns re-render without `<think>`

ROOT = Path(__file__).parents[1]


# A chat agent plugin, as a module (chat agent names are checked when the config loads).
TWO_TURNS = """
import openai

from molt_core import hookimpl


class TwoTurns:
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = [{"role": "user", "content": "first"}]
        r = await client.chat.completions.create(model=ctx.model, messages=messages)
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": "second"}]
        r = await client.chat.completions.create(model=ctx.model, messages=messages)
        await client.close()
        return [0.0, float(len(r.choices[0].message.content or "") % 3)]


@hookimpl
def molt_chat_agents():
    return {"two_turns": TwoTurns}
"""


class Recorder:
    """Test plugin: the groups each step trains on (the last batch filter sees them)."""

    def __init__(self) -> None:
        self.steps: list[list] = []

    @hookimpl
    def molt_filter_batch(self, groups, step):
        self.steps.append([t for g in groups for t in g])


def run(recipe: str, model_dir: Path, tmp_path: Path, *overrides: str,
        plugins: tuple[str, ...] = ()):
    data = yaml.safe_load(open(ROOT / recipe))
    data["model"]["path"] = str(model_dir)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    rec = Recorder()
    cfg, plugins = load(str(path), ["trainer.steps=3", "rollout.groups_per_step=2",
                                    "rollout.group_size=3", "check.consistency_every=1",
                                    *overrides], list(plugins))
    plugins.pm.register(rec, name="recorder")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train(cfg, plugins, run_dir, progress=False)
    return rec.steps, run_dir, AutoTokenizer.from_pretrained(model_dir)


def assert_same(steps, run_dir, tok, every: int = 1, per_step: int = 0):
    rows = read_trajectories(run_dir)
    saved = [s for s in range(1, len(steps) + 1) if (s - 1) % every == 0]    # step k: k-th update
    assert sorted({r["step"] for r in rows}) == saved
    for s in saved:
        got = [r for r in rows if r["step"] == s]
        want = steps[s - 1][:per_step or None]
        assert len(got) == len(want)
        for r, t in zip(got, want):
            assert (r["group_id"], r["rollout_id"], r["reward"]) == (t.group_id, t.rollout_id,
                                                                     t.reward)
            assert r["token_ids"] == t.token_ids and r["loss_mask"] == t.loss_mask
            assert r["versions"] == t.versions and r["turn_rewards"] == t.turn_rewards
            assert r["segments"] == sorted(set(t.segments) | {0})
            behavior = torch.tensor(t.logprobs, dtype=torch.float32)
            assert torch.equal(torch.tensor(r["behavior_logprobs"]), behavior)
            # the trainer's pre-update log-probs: 0 off the mask, the engine's on it (sync run:
            # every token is on-policy; invariant 3 holds to 1e-3 every step here)
            trainer = torch.tensor(r["trainer_logprobs"])
            mask = torch.tensor(t.loss_mask)
            assert trainer.shape == behavior.shape and (trainer[~mask] == 0).all()
            assert (trainer[mask] - behavior[mask]).abs().max() < 1e-3
            assert (trainer[mask] != 0).all()
            bounds = r["segments"] + [len(t)]
            assert r["segment_text"] == [tok.decode(t.token_ids[a:b])
                                         for a, b in zip(bounds, bounds[1:])]
    return rows


def test_multi_turn_gym_run_saves_a_sample_of_what_was_trained(ray_local, tiny_chars_dir,
                                                                tmp_path):
    steps, run_dir, tok = run("recipes/cpu/guess_number.yaml", tiny_chars_dir, tmp_path,
                              "log.trajectories_every=2", "log.trajectories_per_step=4")
    rows = assert_same(steps, run_dir, tok, every=2, per_step=4)
    # env feedback between the turns is masked
    assert all(0 < r["loss_mask"].count(True) < len(r["loss_mask"]) - 1 for r in rows)
    assert all(r["task"] >= 0 for r in rows)


def test_multi_segment_chat_run_saves_what_was_trained(ray_local, tiny_model_dir, tmp_path,
                                                        monkeypatch):
    (tmp_path / "molt_test_two_turns.py").write_text(TWO_TURNS)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = tmp_path / "think"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(model)
    steps, run_dir, tok = run("recipes/cpu/chat_calculator.yaml", model, tmp_path,
                              "agent.args={agent: two_turns}", "sampling.max_new_tokens=4",
                              plugins=("molt_test_two_turns",))
    rows = assert_same(steps, run_dir, tok)
    assert all(len(r["segments"]) == 2 and len(r["turn_rewards"]) == 2 for r in rows)
    assert "turn_spans" in rows[0]["info"]


def test_vl_run_saves_what_was_trained_with_images_by_reference(ray_local, tiny_vl_dir,
                                                                 tmp_path):
    steps, run_dir, tok = run("recipes/cpu/vl_colour.yaml", tiny_vl_dir, tmp_path)
    rows = assert_same(steps, run_dir, tok)
    for r, t in zip(rows, [t for s in steps for t in s]):
        assert len(r["images"]) == len(t.images) >= 1
        for im, want in zip(r["images"], t.images):
            assert (im["start"], im["num_tokens"], im["grid_thw"]) == (want.start, want.num_tokens,
                                                                       list(want.grid_thw))
            pixels = load_file(run_dir / "trajectories/images" / f"{im['ref']}.safetensors")
            assert torch.equal(pixels["pixel_values"], want.pixel_values)


def make_trajs(tok, step: int, reward: float = 0.0, n: int = 2) -> list:
    from molt_core.trajectory import Completion, Trajectory

    trajs = []
    for r in range(n):
        t = Trajectory(step, r, reward=reward + r)
        t.add_prompt(tok("after a", add_special_tokens=False).input_ids)
        t.add_completion(Completion([5], [-0.5], [step]))
        trajs.append(t)
    return trajs


def test_writer_thread_without_trainer_logprobs(tiny_chars_dir, tmp_path):
    """The writer on its own (no Ray): a sample per step, no trainer log-probs recorded."""
    from molt_core.run.trajectory_store import TrajectoryWriter

    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    writer = TrajectoryWriter(tmp_path, tok, every=1, per_step=1, task_of=lambda g: 10 + g)
    for step in range(3):
        writer.write(step, make_trajs(tok, step))
    writer.close()
    rows = read_trajectories(tmp_path)
    assert [(r["step"], r["rollout_id"], r["task"]) for r in rows] == [(0, 0, 10), (1, 0, 11),
                                                                       (2, 0, 12)]
    assert all(r["trainer_logprobs"] == [] and r["versions"][-1] == r["step"] for r in rows)
    assert rows[0]["segment_text"] == [tok.decode(rows[0]["token_ids"])]


def test_resumed_run_replaces_later_steps_and_a_dead_loop_leaves_what_it_sent(tiny_chars_dir,
                                                                              tmp_path):
    """A resumed run's steps replace what an earlier run saved from its first step on (several
    files read back as one run); a loop that dies mid-hand-off leaves every step it sent whole on
    disk (the writer sees the pipe's end and writes what it holds)."""
    from molt_core.run.trajectory_store import _SERVE, TrajectoryWriter

    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    for start, steps, reward in ((0, range(6), 0.0), (3, range(3, 5), 10.0)):
        writer = TrajectoryWriter(tmp_path, tok, start=start)
        for step in steps:
            writer.write(step, make_trajs(tok, step, reward))
        writer.close()
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    proc.stdin.write(pickle.dumps((tmp_path / "trajectories", tok, 5)))
    for step in (5, 6, 7):      # step 7 cut off halfway, as by a killed loop
        blob = pickle.dumps((step, make_trajs(tok, step, 20.0), {}, None))
        proc.stdin.write(blob if step < 7 else blob[:len(blob) // 2])
    proc.stdin.close()
    assert proc.wait(timeout=300) == 0
    rows = read_trajectories(tmp_path)
    assert [(r["step"], r["reward"]) for r in rows] == [
        (s, base + r) for s, base in ((0, 0), (1, 0), (2, 0), (3, 10), (4, 10), (5, 20), (6, 20))
        for r in (0, 1)]
    names = {f.name for f in (tmp_path / "trajectories").iterdir()}
    assert {"step_000003.parquet", "step_000005.parquet"} <= names   # no temporary files left
    assert all(n.startswith("step_") and n.endswith(".parquet") for n in names)


def test_a_resumed_writer_waits_for_the_killed_runs_writer(tiny_chars_dir, tmp_path):
    """Driver SIGKILLed: its writer (idle priority, behind) still holds steps 0-5 and writes them
    when it gets to. The resumed run's writer (from step 3) waits for it before replacing steps
    3 on, so each step is saved once, not the old writer's 3-5 beside the new ones."""
    import signal

    from molt_core.run.trajectory_store import (_SERVE, TrajectoryWriter, trajectory_rows,
                                                write_trajectories)

    def seed(step: int) -> Path:     # a file of an earlier run, which a writer's start removes
        path = tmp_path / "trajectories" / f"step_{step:06d}.parquet"
        write_trajectories(path, trajectory_rows(step, make_trajs(tok, step), tok))
        return path

    def poll(done) -> None:          # a safety net for a hung writer, not a timing
        for _ in range(600):
            if done():
                return
            time.sleep(0.5)

    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    (tmp_path / "trajectories").mkdir()
    started = seed(99)
    old = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    old.stdin.write(pickle.dumps((tmp_path / "trajectories", tok, 0)))
    old.stdin.flush()
    poll(lambda: not started.exists())
    old.send_signal(signal.SIGSTOP)                 # starved: it reads nothing more for now
    for step in range(6):
        old.stdin.write(pickle.dumps((step, make_trajs(tok, step, 0.0), {}, None)))
    old.stdin.close()                               # its driver is gone
    started = seed(98)
    new = TrajectoryWriter(tmp_path, tok, start=3)
    for step in range(3, 6):
        new.write(step, make_trajs(tok, step, 10.0))
    # the new writer has replaced steps 3 on, or it waits for the old one (a file lock)
    poll(lambda: not started.exists() or "lock" in Path(f"/proc/{new.proc.pid}/wchan").read_text())
    old.send_signal(signal.SIGCONT)
    new.close()
    assert old.wait(timeout=300) == 0
    rows = read_trajectories(tmp_path)
    assert sorted((r["step"], r["reward"]) for r in rows) == [
        (s, (10 if s >= 3 else 0) + r) for s in range(6) for r in (0, 1)]


@pytest.fixture
def full_tmpfs(tmp_path: Path):
    with tmpfs(tmp_path / "disk") as disk:
        fill(disk)
        yield disk


@pytest.mark.parametrize("starved", [False, True])
def test_writer_on_a_full_disk_stops_the_run_with_one_clear_error(tiny_chars_dir, tmp_path,
                                                                   full_tmpfs, monkeypatch,
                                                                   starved):
    """ENOSPC at the writer's first flush (a real full tmpfs), by the writer or (starved) by
    the driver taking over: `flush` (each checkpoint's) and the next `write` raise a
    `RunDirError` naming the directory, the error and the free space; no temporary file is left."""
    import signal

    from molt_core.run import trajectory_store
    from molt_core.run.metrics import RunDirError
    from molt_core.run.trajectory_store import TrajectoryWriter

    monkeypatch.setattr(trajectory_store, "STARVED_S", 0.0 if starved else 600.0)

    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    writer = TrajectoryWriter(full_tmpfs, tok)
    if starved:
        writer.proc.send_signal(signal.SIGSTOP)
    writer.write(0, make_trajs(tok, 0) * 50)
    try:
        with pytest.raises(RunDirError, match=rf"cannot save trajectories to {full_tmpfs}/"
                           r"trajectories: \w+: .*No space left on device.* \(\d+ bytes free"
                           r"\)\. The steps saved so far are kept.*no checkpoint yet"):
            writer.flush()
        with pytest.raises(RunDirError, match="cannot save trajectories"):
            writer.write(1, make_trajs(tok, 1))
    finally:
        writer.close()
    assert list((full_tmpfs / "trajectories").iterdir()) == []


# A loop's last steps, its final flush (the last checkpoint's) and exit, as `train` ends, with a
# writer that gets no CPU at all (SIGSTOP: as a busy machine starves an idle-priority process,
# also where its priority can be raised, as here when root): what is on disk when close returns
_LAST_STEPS = """import os, signal, sys
from pathlib import Path
from transformers import AutoTokenizer
from molt_core.run import trajectory_store as store
from molt_tools.view import read_trajectories
from test_trajectory_store import make_trajs
tok = AutoTokenizer.from_pretrained(sys.argv[1])
store.STARVED_S = 1.0                   # the test's wait; the outcome is the same at 10 s
writer = store.TrajectoryWriter(Path(sys.argv[2]), tok)
os.kill(writer.proc.pid, signal.SIGSTOP)
for step in range(1, 21):
    writer.write(step, make_trajs(tok, step, n=8))
writer.flush()                          # the last checkpoint's
writer.write(21, make_trajs(tok, 21))   # to the new writer, from step 21
os.kill(writer.proc.pid, signal.SIGSTOP)
writer.close()
print(sorted({r["step"] for r in read_trajectories(sys.argv[2])}), writer.proc.pid, flush=True)
"""


@contextlib.contextmanager
def busy_machine():
    """A sibling busy loop per core (2 at least), killed (by pid) when the block ends."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(max(2, os.cpu_count() or 1))]
    try:
        yield
    finally:
        for p in spin:
            p.kill()
            p.wait()


def test_a_run_on_a_busy_machine_exits_with_its_trajectories_saved(tiny_chars_dir, tmp_path):
    """Issue 45.1: every core busy with siblings; the run's writer gets no CPU from some step
    on. Its last flush and close still return with every step on disk, saved by the driver, and
    the writer ended: the process exits and says which steps it saved itself and where. (Before:
    the flush waited up to 600 s, close 60 s and left the steps to the starved writer.)"""
    with busy_machine():
        out = subprocess.run([sys.executable, "-c", _LAST_STEPS, str(tiny_chars_dir),
                              str(tmp_path)], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-3000:]
    steps, pid = out.stdout.splitlines()[-1].rsplit(" ", 1)
    assert steps == str(list(range(1, 22)))              # on disk when close returned
    assert not Path(f"/proc/{pid}").exists()               # the writer is gone too
    said = [line for line in (out.stdout + out.stderr).splitlines() if "writer starved" in line]
    assert all(f"dir={tmp_path}/trajectories" in line for line in said)
    assert [s.rsplit("steps=", 1)[1] for s in said] == ["1-20", "21-21"], said
    rows = read_trajectories(tmp_path)
    assert len(rows) == 20 * 8 + 2                        # each rollout once
    assert len({(r["step"], r["rollout_id"]) for r in rows}) == len(rows)


def test_molt_rollout_on_a_busy_machine_exits_with_its_rollouts_saved(tiny_recipe, tmp_path):
    """Issue 45.1, `molt rollout -n 4` beside busy siblings: it exits (0) with its Parquet file
    written; nothing of it is left running."""
    import psutil

    mark = f"MOLT_TEST_BUSY_{os.getpid()}_{time.monotonic_ns()}"   # inherited by what it starts

    def left() -> list:
        out = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                out += [p.pid] if mark in p.environ() else []
        return out

    with busy_machine():
        proc = subprocess.run([sys.executable, "-m", "molt_tools", "rollout", tiny_recipe,
                               "-n", "4", f"out_dir={tmp_path / 'out'}"], capture_output=True,
                              text=True, timeout=600,      # a hang guard, not a timing
                              env={**os.environ, mark: "1", "RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_trajectories(next((tmp_path / "out").iterdir()))) == 4
    assert left() == []


def test_the_loop_waiting_on_a_flush_lifts_the_writers_idle_priority(tiny_chars_dir, tmp_path,
                                                                     monkeypatch):
    """While the loop waits for a flush (a checkpoint, the run's end), the writer runs at
    normal priority (where the OS allows: root or RLIMIT_NICE), idle again after it. The writer
    is held (SIGSTOP: starved) until the lift is seen (no take-over by the driver meanwhile)."""
    import signal
    import threading

    from molt_core.run import trajectory_store
    from molt_core.run.trajectory_store import TrajectoryWriter

    monkeypatch.setattr(trajectory_store, "STARVED_S", 600.0)

    def policy_becomes(want: int) -> None:     # a hang guard, not a timing
        for _ in range(600):
            if os.sched_getscheduler(writer.proc.pid) == want:
                return
            time.sleep(0.1)
        raise AssertionError(f"writer policy {os.sched_getscheduler(writer.proc.pid)}")

    import resource
    if os.geteuid() and resource.getrlimit(resource.RLIMIT_NICE)[0] < 20:
        pytest.skip("leaving SCHED_IDLE needs root or RLIMIT_NICE >= 20")
    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    writer = TrajectoryWriter(tmp_path, tok)
    writer.write(0, make_trajs(tok, 0))
    writer.flush()
    assert os.sched_getscheduler(writer.proc.pid) == os.SCHED_IDLE
    writer.write(1, make_trajs(tok, 1))

    def raised_while(action) -> None:
        """The stopped writer runs at normal priority while the driver waits on `action`."""
        writer.proc.send_signal(signal.SIGSTOP)
        waiting = threading.Thread(target=action)
        waiting.start()
        try:
            policy_becomes(os.SCHED_OTHER)
        finally:
            writer.proc.send_signal(signal.SIGCONT)
            waiting.join()
    raised_while(writer.flush)
    assert os.sched_getscheduler(writer.proc.pid) == os.SCHED_IDLE
    writer.write(2, make_trajs(tok, 2))
    raised_while(writer.close)
    assert writer.proc.poll() is not None            # ended once all is on disk
    assert sorted({r["step"] for r in read_trajectories(tmp_path)}) == [0, 1, 2]
