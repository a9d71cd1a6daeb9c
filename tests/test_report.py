"""`molt report` on two real tiny runs: one PNG per plot with information, each series in the
legend under its run's name, flat plots skipped and listed, an index.html showing every plot."""

from __future__ import annotations

import re

import matplotlib.image
import pytest

from molt_tools.commands import main
from molt_tools.report import PLOTS, ema, write_report
from real_runs import real_run


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_chars_dir):
    root = tmp_path_factory.mktemp("report-runs")
    a = real_run(root / "a", tiny_chars_dir, "trainer.steps=6", "name=alpha")
    b = real_run(root / "b", tiny_chars_dir, "trainer.steps=4", "name=beta", "seed=2",
                 "algorithm.terms.kl_coef=0.05")
    return a, b


def test_report_on_two_real_runs(two_runs, tmp_path):
    a, b = two_runs
    out = tmp_path / "out"
    drawn, skipped = write_report([a, b], out)
    assert {p.stem for p in out.glob("*.png")} == set(drawn)
    assert set(drawn) | set(skipped) == set(PLOTS) and not set(drawn) & set(skipped)
    assert {"reward", "loss", "grad_norm", "entropy", "mismatch", "step_time"} <= set(drawn)
    assert skipped["clip_fraction"] == "every value is 0"       # one optimizer step a batch
    assert skipped["staleness"] == "every value is 0"           # sync rollouts
    for plot, series in drawn.items():
        runs = {s.split(": ")[0] for s in series}
        assert runs == ({b.name} if plot == "policy_kl" else {a.name, b.name}), plot
        assert all(n > 0 for n in series.values()), plot
        img = matplotlib.image.imread(out / f"{plot}.png")
        assert img.shape[0] > 100 and img[..., :3].std() > 0.05, plot
    assert drawn["reward"] == {f"{a.name}: reward/{k}": 6 for k in ("mean", "max", "min")} | \
        {f"{b.name}: reward/{k}": 4 for k in ("mean", "max", "min")}
    parts = {s.split(": ")[1] for s in drawn["step_time"]}
    assert parts == {"time/generate_s", "train/fwd_bwd_s", "train/optim_s", "time/weight_sync_s",
                     "other"}
    index = (out / "index.html").read_text()
    assert re.findall(r'<img src="(\w+)\.png"', index) == list(drawn)
    assert all(PLOTS[n][0] in index.split("Skipped")[1] for n in skipped)


def test_one_run_kl_off_wall_time_axis_and_the_command(two_runs, tmp_path, capsys):
    a, _ = two_runs
    drawn, skipped = write_report([a], tmp_path / "t", smoothing=0.0, x="time")
    assert skipped["policy_kl"] == "algorithm.terms.kl_coef is 0"
    assert drawn["reward"] == {f"{a.name}: reward/mean": 6, f"{a.name}: reward/max": 6,
                               f"{a.name}: reward/min": 6}
    assert main(["report", str(a), "--smoothing", "0.9"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"report: {a / 'report' / 'index.html'} (") and "skipped" in out
    assert main(["report", str(a), "--smoothing", "1"]) == 2


def test_ema_is_debiased_and_zero_smoothing_is_raw():
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert ema([0.0, 1.0], 0.0) == [0.0, 1.0]
    assert ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 2 / 3])
