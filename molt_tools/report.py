"""`molt report RUN_DIR [RUN_DIR ...]`: PNG plots of a run's `metrics.jsonl`, several runs
overlaid (one colour per run): reward, eval, KL, entropy, clip fraction, mismatch, staleness,
response length, step-time breakdown, tokens/s."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["PLOTS", "add_args", "main", "read_metrics", "write_report"]

# plot -> (title, y label, metric keys; "eval/*" takes every key with that prefix)
PLOTS: dict[str, tuple[str, str, list[str]]] = {
    "reward": ("Reward", "reward", ["reward/mean", "reward/max", "reward/min"]),
    "eval": ("Evaluation", "score", ["eval/*"]),
    "kl": ("KL", "nats / token", ["kl", "mismatch/kl"]),
    "entropy": ("Policy entropy", "nats / token", ["entropy"]),
    "clip_fraction": ("Clip fraction", "fraction of tokens", ["clip_fraction"]),
    "mismatch": ("Engine vs trainer", "log-prob gap", ["mismatch/max_abs", "mismatch/kl"]),
    "staleness": ("Staleness", "weight versions behind",
                  ["rollout/version_lag_mean", "rollout/version_lag_max"]),
    "response_length": ("Response length", "trainable tokens",
                        ["response/len_mean", "response/truncated"]),
    "step_time": ("Step time", "seconds", ["time/generate_s", "time/engine_busy_s",
                                           "train/fwd_bwd_s", "train/optim_s",
                                           "time/weight_sync_s", "time/step_s"]),
    "tokens_per_s": ("Throughput", "trainable tokens / s", ["tokens_per_s"]),
}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """`metrics.jsonl` rows merged per step (training and evaluation rows; a resumed run's
    repeated steps keep their last values), plus `tokens_per_s` (trainable tokens trained per
    second of step)."""
    rows: dict[int, dict[str, Any]] = {}
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.setdefault(row["step"], {}).update(row)
    for row in rows.values():
        if row.get("time/step_s") and "response/len_mean" in row:
            row["tokens_per_s"] = (row["response/len_mean"] * row.get("rollout/trajectories", 1)
                                   / row["time/step_s"])
    return [rows[s] for s in sorted(rows)]


def _keys(pattern: list[str], runs: dict[str, list[dict]]) -> list[str]:
    present = {k for rows in runs.values() for r in rows for k in r}
    out = []
    for p in pattern:
        out += sorted(k for k in present if k.startswith(p[:-1])) if p.endswith("*") else \
            [p] if p in present else []
    return out


def write_report(run_dirs: list[str | Path], out_dir: str | Path) -> dict[str, dict[str, int]]:
    """One PNG per plot with data in `out_dir`; returns {plot: {"run: key": points}}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {_label(Path(d), run_dirs): read_metrics(d) for d in run_dirs}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3))]
    drawn: dict[str, dict[str, int]] = {}
    for name, (title, ylabel, pattern) in PLOTS.items():
        keys = _keys(pattern, runs)
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        series: dict[str, int] = {}
        for i, (label, rows) in enumerate(runs.items()):
            for j, key in enumerate(keys):
                pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ax.plot(xs, ys, linestyle=styles[j % len(styles)], color=colours[i % len(colours)],
                        label=f"{label}: {key}" if len(runs) > 1 else key, linewidth=1.2)
                series[f"{label}: {key}"] = len(pts)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)
        drawn[name] = series
    return drawn


def _label(path: Path, all_dirs: list) -> str:
    names = [Path(d).name for d in all_dirs]
    return path.name if names.count(path.name) == 1 else str(path)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="", help="output folder (default: RUN_DIR/report for one run, "
                                             "report-<first run> beside it for several)")


def main(args: argparse.Namespace) -> int:
    first = Path(args.run_dirs[0])
    out = Path(args.out) if args.out else (first / "report" if len(args.run_dirs) == 1
                                           else first.parent / f"report-{first.name}")
    drawn = write_report(args.run_dirs, out)
    missing = [n for n in PLOTS if n not in drawn]
    print(f"report: {out} ({len(drawn)} plots" + (f"; no data for {', '.join(missing)}"
                                                  if missing else "") + ")")
    return 0
