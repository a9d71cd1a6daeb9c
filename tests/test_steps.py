"""One step-counting convention (issue 41 item 11, issue 45 item 6): `step` = updates done (TRL's
global_step). Step k of 1..N is the k-th update: its metrics row, saved trajectories, checkpoint,
`molt_on_step_end` call and console line all say k; eval rows say 0..N (0: the initial weights);
a resume from step_k goes on at k + 1. A real run: Ray-free embedded engine, FSDP2 trainer."""

from __future__ import annotations

import io
import json
import sys

from molt_core import hookimpl
from molt_core.cli import load
from molt_core.run.metrics import configure_logging
from molt_core.trainer import train
from molt_tools.view import read_trajectories

ARITHMETIC = ["agent.args.env=arithmetic", "eval.agent_args={env_args: {split: test}}",
              "eval.every=1", "eval.prompts=2", "eval.k=1", "rollout.groups_per_step=2",
              "rollout.group_size=2", "trainer.save_every=1", "trainer.keep_last=5"]


class StepEnds:
    """Test plugin: the steps `molt_on_step_end` and `molt_filter_batch` are called with."""

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.filters: list[int] = []

    @hookimpl
    def molt_on_step_end(self, step):
        self.ends.append(step)

    @hookimpl
    def molt_filter_batch(self, step):
        self.filters.append(step)


def _run(recipe: str, run_dir, monkeypatch, steps: int, resume=None):
    cfg, plugins = load(recipe, [*ARITHMETIC, f"trainer.steps={steps}"])
    seen = StepEnds()
    plugins.pm.register(seen, name="step_ends")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    configure_logging(fmt="json")
    try:
        history = train(cfg, plugins, run_dir, progress=False, resume=resume)
    finally:
        monkeypatch.undo()
        configure_logging()
    console = [json.loads(line) for line in err.getvalue().splitlines() if line.startswith("{")]
    return history, seen, console


def test_rows_files_hooks_console_and_checkpoints_count_updates_done(tiny_recipe, tmp_path,
                                                                      monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    history, seen, console = _run(tiny_recipe, run_dir, monkeypatch, 2)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r["step"] for r in rows if "reward/mean" in r]
    eval_rows = [r["step"] for r in rows if "eval/time_s" in r]
    assert train_rows == [1, 2] and eval_rows == [0, 1, 2]
    assert [r["step"] for r in rows] == [0, 1, 1, 2, 2]        # eval 0, step 1, eval 1, ...
    assert [h["step"] for h in history if "eval/time_s" in h] == [0, 1, 2]
    assert seen.ends == [1, 2] and seen.filters == [1, 2]
    assert [(e["event"], e["step"]) for e in console if e["event"] in ("step", "eval")] == [
        ("eval", 0), ("step", "1/2"), ("eval", 1), ("step", "2/2"), ("eval", 2)]
    assert sorted({r["step"] for r in read_trajectories(run_dir)}) == [1, 2]
    evals = read_trajectories(run_dir / "trajectories" / "eval")
    assert sorted({r["step"] for r in evals}) == [0, 1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_000001", "step_000002"]
    meta = json.loads((run_dir / "checkpoints/step_000002/meta.json").read_text())
    assert meta["step"] == 2 and meta["version"] == 2          # 2 updates, 2 weight pushes

    # resumed from step_000002: goes on at step 3 (rows past the checkpoint, eval 2, redone)
    history, seen, console = _run(tiny_recipe, run_dir, monkeypatch, 3,
                                  resume=run_dir / "checkpoints/step_000002")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/time_s" in r] == [0, 1, 2, 3]
    assert seen.ends == [3] and [e["step"] for e in console if e["event"] == "step"] == ["3/3"]
    assert sorted({r["step"] for r in read_trajectories(run_dir)}) == [1, 2, 3]
    assert (run_dir / "checkpoints/step_000003").is_dir()
