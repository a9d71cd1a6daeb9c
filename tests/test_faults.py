"""Faults a run survives or reports clearly (issue 12): failing rollouts dropped alone,
BaseException and NaN rewards in envs, the failure-rate abort, a killed engine, SIGTERM, a full
disk."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from molt_core.run import checkpoint
from molt_core.consistency import consistency_tol
from molt_core.rollout.restarts import EngineDiedError
from molt_core.cli import load
from molt_core.rollout.generator import FailureRateError
from molt_core.trainer import train

from common import toy_recipe

TESTS = Path(__file__).parent


def _recipe(tmp_path: Path, model: Path, **sections) -> str:
    return toy_recipe(tmp_path, model, out_dir=str(tmp_path / "runs"), **sections)


def _popen(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    ray_tmp = tempfile.mkdtemp(prefix="rayft", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "molt_tools", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE), ray_tmp


def _left_behind(ray_tmp: str, polls: int = 120) -> list[str]:
    """Processes of the run's Ray session still alive; polled, since exiting takes a moment."""
    for _ in range(polls):
        out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        left = [line for line in out.splitlines() if ray_tmp in line]
        if not left:
            break
        time.sleep(0.5)
    return left


def test_failing_rollouts_are_dropped_alone(ray_local, tiny_chars_dir, tmp_path, monkeypatch):
    """SystemExit, KeyboardInterrupt, a NaN reward and 10 % RuntimeErrors inside the env: each
    drops its rollout only (its group trains smaller), counted; the run finishes."""
    monkeypatch.syspath_prepend(str(TESTS))
    cfg, plugins = load(_recipe(tmp_path, tiny_chars_dir, agent={"args": {
        "env": "flaky_letter", "chat_template": False}}), ["trainer.steps=3"], ["flaky_env"])
    history = train(cfg, plugins, None, progress=False)
    assert len(history) == 3
    last = history[-1]
    assert last["rollout/dropped/nonfinite_reward"] == 1
    assert last["rollout/dropped/agent_error"] >= 2 + 4       # SystemExit, KeyboardInterrupt, 10 %
    assert last["rollout/smaller_groups"] >= 1
    assert last.get("rollout/dropped/incomplete_group", 0) == 0
    # every rollout was either trained or counted as failed: no group was thrown away
    assert sum(h["rollout/trajectories"] for h in history) + last["rollout/failed"] == 3 * 4 * 4


def test_too_many_failures_abort_naming_the_commonest_error(ray_local, tiny_chars_dir, tmp_path,
                                                           monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    sys.modules.pop("flaky_env", None)           # its step counter starts again
    cfg, plugins = load(_recipe(tmp_path, tiny_chars_dir, agent={"args": {
        "env": "flaky_letter", "chat_template": False}}),
        ["trainer.steps=3", "agent.max_failure_rate=0.05"], ["flaky_env"])
    with pytest.raises(FailureRateError, match=r"rollouts failed \(> agent.max_failure_rate=0.05"
                                               r"\); the commonest error \(\d+x\): "):
        train(cfg, plugins, None, progress=False)


@pytest.mark.parametrize("scheme, kill", [("sync", "end:3"), ("async", "filter:3")])
def test_killed_engine_is_replaced_with_current_weights(ray_local, tiny_chars_dir, tmp_path,
                                                        monkeypatch, scheme, kill):
    """kill -9 of the engine's process. sync, between steps: step 4's requests meet the dead
    engine, are re-issued and wait while the driver starts a new one and pushes it the current
    weights. async, before a train step: the pool's in-flight requests are re-issued, and the
    weight push after the step meets the dead engine and is redone with a new one."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("MOLT_TEST_KILL_ENGINE", kill)
    more = ["rollout.scheme=async", "algorithm.correction=tis"] if scheme == "async" else []
    cfg, plugins = load(_recipe(tmp_path, tiny_chars_dir), [   # an engine process to kill
        "trainer.steps=6", "check.consistency_every=1", "ray.embedded=off", *more],
        ["kill_plugin"])
    history = train(cfg, plugins, None, progress=False)    # every step: engine == trainer
    # counted in the step it happens in: sync, step 4's generation; async, step 3's weight push
    first = 3 if scheme == "sync" else 2
    assert [h["faults/engine_restarts"] for h in history] == [0] * first + [1] * (6 - first)
    assert all(h["mismatch/max_abs"] <= consistency_tol(cfg) for h in history)
    assert history[-1].get("rollout/failed", 0) == 0      # no rollout lost: requests re-issued
    if scheme == "sync":       # the new engine stamps the trainer's version: all on-policy
        assert all(h["mismatch/on_policy_fraction"] == 1.0 for h in history)


def test_engine_deaths_past_max_restarts_stop_the_run(ray_local, tiny_chars_dir, tmp_path,
                                                      monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("MOLT_TEST_KILL_ENGINE", "end:1")
    cfg, plugins = load(_recipe(tmp_path, tiny_chars_dir), [
        "trainer.steps=3", "engine.max_restarts=0", "ray.embedded=off"], ["kill_plugin"])
    with pytest.raises(EngineDiedError, match=r"engine 0 \(.*\) died: ActorDiedError: The actor "
                                              r"died .*engine.max_restarts=0 replacements"):
        train(cfg, plugins, None, progress=False)


def test_nonfinite_reward_names_its_source(tiny_chars_dir, tmp_path):
    from molt_core.rollout.generator import Generator
    from molt_core.trajectory import Trajectory

    class NaNAgent:
        async def rollout(self, ctx):
            t = Trajectory()
            t.add_prompt([1, 2])
            t.reward = float("inf")
            return t
    cfg, _ = load(_recipe(tmp_path, tiny_chars_dir), [])
    gen = Generator(NaNAgent(), [], cfg, None, 100)
    try:
        assert gen.submit(gen.run_one(0, 0)).result() is None
    finally:
        gen.close()
    assert gen.counters["rollout/dropped/nonfinite_reward"] == 1
    assert any("agent 'gym' env 'next_letter' returned reward inf" in e for e in gen._errors)


def test_sigterm_saves_a_checkpoint_and_stops_everything(tiny_chars_dir, tmp_path):
    recipe = _recipe(tmp_path, tiny_chars_dir)
    proc, ray_tmp = _popen("run", recipe, "trainer.steps=500", "--no-progress")
    metrics = None
    for _ in range(1200):                 # a safety net for a hung run, not a speed check
        if proc.poll() is not None:
            break
        found = list((tmp_path / "runs").glob("*/metrics.jsonl"))
        if found and found[0].read_text().count("\n") >= 2:
            metrics = found[0]
            break
        time.sleep(0.5)
    assert metrics is not None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    rows = metrics.read_text().count("\n")
    assert 2 <= rows < 500
    run = metrics.parent
    assert checkpoint.latest(run).name == f"step_{rows:06d}"
    assert "stopped" in err and f"molt run --resume {run}" in err
    assert _left_behind(ray_tmp) == []


def test_full_disk_is_a_clear_error_and_keeps_the_last_checkpoint(tiny_chars_dir, tmp_path):
    recipe = _recipe(tmp_path, tiny_chars_dir)
    out = tmp_path / "runs"
    proc, ray_tmp = _popen("run", recipe, "trainer.steps=6", "trainer.save_every=1",
                           "--plugin", "kill_plugin", "--no-progress",
                           env={"MOLT_TEST_DISK_FULL_AT_STEP": "3",
                                "MOLT_TEST_OUT_DIR": str(out)})
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 2, err[-3000:]
    assert err.count("error: ") == 1 and "cannot append step 3 to" in err
    (run,) = out.iterdir()
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(x)["step"] for x in text.splitlines()] == [1, 2]
    assert checkpoint.latest(run).name == "step_000002"
    assert (checkpoint.export(run, tmp_path / "export") / "model.safetensors").is_file()
    assert _left_behind(ray_tmp) == []


def test_unwritable_checkpoint_dir_is_a_clear_error(tiny_chars_dir, tmp_path):
    cfg, _ = load(_recipe(tmp_path, tiny_chars_dir), [])
    (tmp_path / "checkpoints").write_text("a file where the directory should be")
    ck = checkpoint.Checkpointer(cfg, tmp_path, None, [], None, None, None)
    try:
        with pytest.raises(checkpoint.CheckpointError, match="could not write checkpoint .* the "
                                                             "last complete checkpoint is"):
            ck.save(1)
    finally:
        ck.close()


def test_killed_job_resumes_with_each_steps_trajectories_once_and_leaves_nothing(tiny_chars_dir,
                                                                                 tmp_path):
    """kill -9 of the driver and its trajectory writer after step 4 (as a scheduler cancelling
    the job would; the checkpoint is at 3), then --resume: each of steps 1-8 saved exactly once
    (those before the checkpoint were on disk when it was taken), and no Ray process or session
    folder is left by either run."""
    from collections import Counter

    from molt_tools.view import read_trajectories

    recipe = _recipe(tmp_path, tiny_chars_dir)
    proc, ray_tmp = _popen("run", recipe, "trainer.steps=8", "trainer.save_every=3",
                           "--plugin", "kill_plugin", "--no-progress",
                           env={"MOLT_TEST_KILL_AFTER_STEP": "4", "MOLT_TEST_KILL_WRITER": "1"})
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == -9, err[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert checkpoint.latest(run).name == "step_000003"
    again, ray_tmp2 = _popen("run", "--resume", str(run), "--no-progress")
    _, err = again.communicate(timeout=900)
    assert again.returncode == 0, err[-3000:]
    steps = Counter(r["step"] for r in read_trajectories(run))
    assert sorted(steps.items()) == [(s, 16) for s in range(1, 9)]
    for tmp in (ray_tmp, ray_tmp2):
        assert _left_behind(tmp) == []
        assert os.listdir(tmp) == []       # Ray's session folder, its `session_latest` link


@pytest.fixture
def small_disk(tmp_path):
    from disk import tmpfs

    with tmpfs(tmp_path / "disk", "16m") as disk:
        yield disk


def test_disk_full_in_a_checkpoint_is_one_clear_error_and_keeps_the_earlier(tiny_chars_dir,
                                                                            tmp_path, small_disk):
    """The run dir on a 16 MB tmpfs, filled at step 3's end to 200 kB free: DCP's write of
    checkpoint 3 fails (a CheckpointException holding the ENOSPC, as a RuntimeError); one error
    says what, where, how much space is left and what was kept; the temporary dir is gone and
    checkpoints 1-2 are whole."""
    recipe = _recipe(tmp_path, tiny_chars_dir)
    proc, ray_tmp = _popen("run", recipe, "trainer.steps=6", "trainer.save_every=1",
                           f"out_dir={small_disk / 'runs'}", "--plugin", "kill_plugin",
                           "--no-progress", env={"MOLT_TEST_FILL_DISK_AT": "3:200000",
                                                 "MOLT_TEST_OUT_DIR": str(small_disk)})
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 2, err[-3000:]
    (run,) = (small_disk / "runs").iterdir()
    ckpts = run / "checkpoints"
    assert err.count("error: ") == 1 and "Traceback" not in err, err[-3000:]
    assert re.search(rf"error: could not write checkpoint {ckpts}/step_000003: \w+: .* \(\d+ "
                     r"bytes free there; the last checkpoint took \d{6,}\)\. It was removed; the "
                     rf"last complete checkpoint is {ckpts}/step_000002\. .*molt run --resume "
                     rf"{run}` \(from step_000002\)", err), err[-3000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002"]
    (small_disk / "ballast").unlink()
    assert (checkpoint.export(run, tmp_path / "export") / "model.safetensors").is_file()
    assert _left_behind(ray_tmp) == []


def test_metrics_write_failure_without_a_checkpoint_says_so(tmp_path, small_disk):
    from disk import fill
    from molt_core.run.metrics import MetricsSink, RunDirError

    sink = MetricsSink(small_disk, 10, show=False)
    fill(small_disk)
    try:
        with pytest.raises(RunDirError, match=r"cannot append step 0 to .*No space left on device"
                           r".*start the run again: it has no checkpoint yet"):
            sink.log(0, {"reward/mean": 0.5, "pad": "x" * 10000})
    finally:
        sink.close()


def test_nonfinite_step_count_survives_a_resume(ray_local, tiny_chars_dir, tmp_path, monkeypatch):
    """A NaN loss at step 1 is skipped and counted; resumed from the checkpoint at 2, the count
    goes on from 1 (it was restarted at 0)."""
    monkeypatch.syspath_prepend(str(TESTS))
    recipe = _recipe(tmp_path, tiny_chars_dir, algorithm={"loss": "nan_at_step_1"})
    run = tmp_path / "run"
    run.mkdir()
    cfg, plugins = load(recipe, ["trainer.steps=2"], ["nan_loss_plugin"])
    first = train(cfg, plugins, run, progress=False)
    assert [h["faults/nonfinite_steps"] for h in first] == [0, 1]
    cfg, plugins = load(recipe, ["trainer.steps=4"], ["nan_loss_plugin"])
    resumed = train(cfg, plugins, run, progress=False, resume=run)
    assert [h["faults/nonfinite_steps"] for h in resumed] == [1, 1]


def test_an_engine_killed_while_a_checkpoint_is_written_is_replaced(ray_local, tiny_chars_dir,
                                                                    tmp_path, monkeypatch):
    """kill -9 of the engine inside the first checkpoint write (ray.embedded off): the save takes
    Ray's word that the actor died (at once), saves without that engine's RNG, and the next step
    replaces the engine. (Before: the ActorDiedError stopped the run, no checkpoint; the issue
    saw the save wait engine.timeout_s, ~150 s.)"""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("MOLT_TEST_KILL_ENGINE", "save:1")
    cfg, plugins = load(_recipe(tmp_path, tiny_chars_dir), [
        "trainer.steps=3", "trainer.save_every=1", "ray.embedded=off", "engine.timeout_s=3000"],
        ["kill_plugin"])
    (tmp_path / "run").mkdir()
    history = train(cfg, plugins, tmp_path / "run", progress=False)
    assert [h["faults/engine_restarts"] for h in history] == [0, 1, 1]
    assert checkpoint.latest(tmp_path / "run").name == "step_000003"
