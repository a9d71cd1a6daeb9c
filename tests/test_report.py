"""`molt report`: two runs' metrics overlaid, one PNG per plot, each with both runs' data."""

from __future__ import annotations

import json
import math

import matplotlib.image

from molt_tools.commands import main
from molt_tools.report import PLOTS, write_report

KEYS = ["reward/mean", "reward/max", "reward/min", "eval/accuracy", "kl", "mismatch/kl",
        "entropy", "clip_fraction", "mismatch/max_abs", "rollout/version_lag_mean",
        "rollout/version_lag_max", "response/len_mean", "response/truncated", "time/generate_s",
        "train/fwd_bwd_s", "train/optim_s", "time/weight_sync_s", "time/step_s",
        "rollout/trajectories"]


def fake_run(path, shift: float, steps: int = 6):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(steps):
            row = {k: abs(math.sin(s + i + shift)) + 0.1 for i, k in enumerate(KEYS)}
            evaluation = {"eval/accuracy": row.pop("eval/accuracy")}
            f.write(json.dumps({"step": s, "time": 1e9 + s, "elapsed_s": s, **row}) + "\n")
            if s % 2 == 0:                        # evaluation rows of their own, every 2 steps
                f.write(json.dumps({"step": s, **evaluation}) + "\n")


def test_report_on_two_runs(tmp_path, capsys):
    a, b = tmp_path / "run-a", tmp_path / "run-b"
    fake_run(a, 0.0)
    fake_run(b, 1.0, steps=4)
    drawn = write_report([a, b], tmp_path / "out")
    assert set(drawn) == set(PLOTS)
    for plot, series in drawn.items():
        assert {s.split(":")[0] for s in series} == {"run-a", "run-b"}, plot
        assert all(n > 0 for n in series.values())
        img = matplotlib.image.imread(tmp_path / "out" / f"{plot}.png")
        assert img.shape[0] > 100 and img[..., :3].std() > 0.05, plot
    assert drawn["eval"] == {"run-a: eval/accuracy": 3, "run-b: eval/accuracy": 2}
    assert drawn["tokens_per_s"]["run-b: tokens_per_s"] == 4
    assert drawn["reward"]["run-a: reward/mean"] == 6, "evaluation rows merge into their step"
    assert main(["report", str(a)]) == 0
    assert f"report: {a / 'report'} (10 plots)" in capsys.readouterr().out
    assert len(list((a / "report").glob("*.png"))) == len(PLOTS)
