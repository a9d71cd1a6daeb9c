"""`molt report` on two real tiny runs: one PNG per plot with information, each series in the
legend under its run's name, flat plots skipped and listed, an index.html showing every plot;
held-out scores and their seconds in separate panels; an EMA only over long enough series."""

from __future__ import annotations

import re

import matplotlib.image
import pytest

from molt_tools.commands import main
from molt_tools.report import PLOTS, SMOOTH_MIN, _line_plot, ema, write_report
from real_runs import real_run


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_chars_dir):
    root = tmp_path_factory.mktemp("report-runs")
    a = real_run(root / "a", tiny_chars_dir, "trainer.steps=6", "name=alpha")
    b = real_run(root / "b", tiny_chars_dir, "trainer.steps=4", "name=beta", "seed=2",
                 "algorithm.terms.kl_coef=0.05", "agent.args={env: arithmetic}", "eval.every=2",
                 "eval.agent_args={env_args: {split: test}}", "eval.prompts=4", "eval.k=2",
                 "eval.success=0.0")     # the tiny model scores 0: every rollout solved
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
        only_b = plot in ("policy_kl", "eval", "eval_time")
        assert runs == ({b.name} if only_b else {a.name, b.name}), plot
        assert all(n > 0 for n in series.values()), plot
        img = matplotlib.image.imread(out / f"{plot}.png")
        assert img.shape[0] > 100 and img[..., :3].std() > 0.05, plot
    assert drawn["reward"] == {f"{a.name}: reward/{k}": 6 for k in ("mean", "max", "min")} | \
        {f"{b.name}: reward/{k}": 4 for k in ("mean", "max", "min")}
    # held-out scores on one axis, their seconds on their own: evaluations before steps 0, 2, 4
    assert drawn["eval"] == {f"{b.name}: eval/{m}": 3 for m in (
        "greedy/pass@1", "greedy/reward_mean", "sampled/pass@1", "sampled/pass@2",
        "sampled/reward_mean")}
    assert drawn["eval_time"] == {f"{b.name}: eval/time_s": 3}
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


def test_smoothing_only_over_series_long_enough(two_runs):
    """A 6-step run's reward is drawn raw (each point marked) under --smoothing 0.9; the same
    values repeated to SMOOTH_MIN steps get the faint raw line and the EMA over it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from molt_tools.report import read_metrics

    rows = read_metrics(two_runs[0])
    long = [{**rows[i % len(rows)], "step": i} for i in range(SMOOTH_MIN)]
    for data, drawn in ((rows, [(None, ".")]), (long, [(0.25, "None"), (None, "None")])):
        _, ax = plt.subplots()
        _line_plot(ax, {"run": data}, ["reward/mean"], "step", 0.9)
        assert [(line.get_alpha(), line.get_marker()) for line in ax.lines] == drawn
        if len(drawn) == 2:                           # the EMA of the raw values
            assert list(ax.lines[1].get_ydata()) == pytest.approx(
                ema([r["reward/mean"] for r in long], 0.9))
        plt.close("all")
