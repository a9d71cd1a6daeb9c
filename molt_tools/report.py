"""`molt report RUN_DIR [RUN_DIR ...]`: PNG plots of runs' `metrics.jsonl` and an `index.html`
showing them all. Several runs overlay (legend by run name); each series has its own colour, the
raw values faint with an EMA on top (`--smoothing`, as W&B's) where a series has `SMOOTH_MIN`
points or more (fewer: the raw values, marked); x by step or wall time. A plot without information (no data, every value the same, policy KL when `algorithm.terms.kl_coef` is
0) is skipped and listed. Step time is a stacked breakdown, one panel per run."""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from molt_core.run.metrics import namespaced

__all__ = ["PLOTS", "SMOOTH_MIN", "STACK", "add_args", "ema", "main", "read_metrics",
           "write_report"]

# plot -> (title, y label, metric keys; "eval/*" takes every key with that prefix that no plot
# names: scores share a panel, seconds get their own)
PLOTS: dict[str, tuple[str, str, list[str]]] = {
    "reward": ("Reward", "reward", ["reward/mean", "reward/max", "reward/min"]),
    "eval": ("Evaluation", "score", ["eval/*"]),
    "eval_time": ("Evaluation time", "seconds", ["eval/time_s"]),
    "loss": ("Loss", "loss", ["train/loss"]),
    "grad_norm": ("Gradient norm (before clipping)", "L2 norm", ["train/grad_norm"]),
    "policy_kl": ("Policy KL to the reference", "nats / token", ["policy/kl_ref"]),
    "entropy": ("Policy entropy", "nats / token", ["train/entropy"]),
    "clip_fraction": ("Clip fraction", "fraction of tokens", ["policy/clip_fraction"]),
    "mismatch": ("Engine vs trainer mismatch", "log-prob gap", ["mismatch/kl", "mismatch/max_abs"]),
    "staleness": ("Staleness", "weight versions behind",
                  ["rollout/version_lag_mean", "rollout/version_lag_max"]),
    "response_length": ("Response length", "trainable tokens", ["response/len_mean"]),
    "truncated": ("Truncated responses", "fraction of rollouts", ["response/truncated"]),
    "tokens_per_s": ("Throughput", "trainable tokens / s", ["tokens_per_s"]),
    "step_time": ("Step time breakdown", "seconds", ["time/step_s"]),
}
# the step-time stack: disjoint parts of time/step_s, the rest drawn as "other"
STACK = ["time/generate_s", "train/fwd_bwd_s", "train/optim_s", "time/weight_sync_s"]
NAMED = {k for _, _, keys in PLOTS.values() for k in keys if not k.endswith("*")}
SMOOTH_MIN = 20     # an EMA over fewer points is mostly its start-up (0.59 where the raw was 0.1)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """`metrics.jsonl` rows merged per step (training and evaluation rows; a resumed run's
    repeated steps keep their last values), plus `tokens_per_s` (trainable tokens trained per
    second of step) and `wall_min` (minutes since the run's first row)."""
    rows: dict[int, dict[str, Any]] = {}
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for line in f:
            if line.strip():
                row = namespaced(json.loads(line))     # a run dir from before the rename
                rows.setdefault(row["step"], {}).update(row)
    t0 = min((r["time"] for r in rows.values() if "time" in r), default=0.0)
    for row in rows.values():
        if row.get("time/step_s") and "response/len_mean" in row:
            row["tokens_per_s"] = (row["response/len_mean"] * row.get("rollout/trajectories", 1)
                                   / row["time/step_s"])
        if "time" in row:
            row["wall_min"] = (row["time"] - t0) / 60
    return [rows[s] for s in sorted(rows)]


def ema(ys: list[float], smoothing: float) -> list[float]:
    """Debiased exponential moving average (W&B's "smoothing"); 0 returns `ys`."""
    out, last = [], 0.0
    for n, y in enumerate(ys, 1):
        last = smoothing * last + (1 - smoothing) * y
        out.append(last / (1 - smoothing ** n))
    return out


def _keys(pattern: list[str], runs: dict[str, list[dict]]) -> list[str]:
    present = {k for rows in runs.values() for r in rows for k in r}
    out = []
    for p in pattern:
        out += sorted(k for k in present if k.startswith(p[:-1]) and k not in NAMED) \
            if p.endswith("*") else [p] if p in present else []
    return out


def _points(rows: list[dict], key: str, x: str) -> list[tuple[float, float]]:
    return [(r[x], r[key]) for r in rows
            if isinstance(r.get(key), (int, float)) and isinstance(r.get(x), (int, float))]


def _kl_off(run_dirs: list[Path]) -> bool:
    """Every run has `algorithm.terms.kl_coef` 0: its `policy/kl_ref` is no KL worth a plot."""
    def coef(d: Path) -> float:
        try:
            cfg = yaml.safe_load((d / "config.yaml").read_text()) or {}
        except OSError:
            return 1.0
        terms = (cfg.get("algorithm") or {}).get("terms") or {}
        return float(terms.get("kl_coef", 0.0) or 0.0)
    return all(coef(d) == 0 for d in run_dirs)


def _why_skipped(name: str, keys: list[str], runs: dict, x: str, kl_off: bool) -> str:
    if name == "policy_kl" and kl_off:
        return "algorithm.terms.kl_coef is 0"
    values = {v for rows in runs.values() for k in keys for _, v in _points(rows, k, x)}
    if not values:
        return "no data"
    return f"every value is {values.pop():g}" if len(values) == 1 else ""


def _line_plot(ax: Any, runs: dict, keys: list[str], x: str, smoothing: float) -> dict[str, int]:
    import matplotlib.pyplot as plt
    n = len(runs) * len(keys)
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    series: dict[str, int] = {}
    for label, rows in runs.items():
        for key in keys:
            pts = _points(rows, key, x)
            if not pts:
                continue
            xs, ys = zip(*pts)
            colour, name = cmap(len(series) % cmap.N), f"{label}: {key}" if len(runs) > 1 else key
            if smoothing > 0 and len(pts) >= SMOOTH_MIN:
                ax.plot(xs, ys, color=colour, alpha=0.25, linewidth=1)
                ax.plot(xs, ema(list(ys), smoothing), color=colour, linewidth=1.6, label=name)
            else:
                ax.plot(xs, ys, color=colour, linewidth=1.4, label=name, marker="." if len(pts) < 30 else None)
            series[f"{label}: {key}"] = len(pts)
    ax.legend(fontsize=7)
    return series


def _stack_plot(axes: list, runs: dict, x: str) -> dict[str, int]:
    """One stacked panel per run: STACK parts, then `other` (step time not in a part)."""
    import matplotlib.pyplot as plt
    cmap, series = plt.get_cmap("tab10"), {}
    for ax, (label, rows) in zip(axes, runs.items()):
        rows = [r for r in rows if isinstance(r.get("time/step_s"), (int, float)) and x in r]
        parts = [k for k in STACK if any(k in r for r in rows)]
        layers = [[r.get(k, 0.0) for r in rows] for k in parts]
        other = [max(r["time/step_s"] - sum(r.get(k, 0.0) for k in parts), 0.0) for r in rows]
        ax.stackplot([r[x] for r in rows], *layers, other, labels=[*parts, "other"],
                     colors=[cmap(i) for i in range(len(parts) + 1)], alpha=0.85)
        ax.set_title(label, fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
        series.update({f"{label}: {k}": len(rows) for k in [*parts, "other"]})
    return series


def write_report(run_dirs: list[str | Path], out_dir: str | Path, smoothing: float = 0.6,
                 x: str = "step") -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """One PNG per plot with information in `out_dir`, and `index.html`; returns
    ({plot: {"run: key": points}}, {skipped plot: why}). `x`: "step" or "time" (wall minutes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    dirs = [Path(d) for d in run_dirs]
    runs = {_label(d, dirs): read_metrics(d) for d in dirs}
    xkey, xlabel = ("wall_min", "wall time (min)") if x == "time" else ("step", "step")
    out_dir, kl_off = Path(out_dir), _kl_off(dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, dict[str, int]] = {}
    skipped: dict[str, str] = {}
    for name, (title, ylabel, pattern) in PLOTS.items():
        keys = _keys(pattern, runs)
        why = _why_skipped(name, keys or pattern, runs, xkey, kl_off)
        if why:
            skipped[name] = why
            continue
        stacked = name == "step_time"
        fig, axes = plt.subplots(1, len(runs) if stacked else 1, squeeze=False, sharey=True,
                                 figsize=(7 if not stacked else 4 + 3 * len(runs), 4))
        axes = list(axes[0])
        drawn[name] = (_stack_plot(axes, runs, xkey) if stacked
                       else _line_plot(axes[0], runs, keys, xkey, smoothing))
        for ax in axes:
            ax.set(xlabel=xlabel)
            ax.grid(alpha=0.3)
            if x == "step":
                ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        axes[0].set_ylabel(ylabel)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)
    _index(out_dir, list(runs), drawn, skipped)
    return drawn, skipped


def _index(out_dir: Path, runs: list[str], drawn: dict, skipped: dict) -> None:
    imgs = "\n".join(f'<figure><img src="{n}.png" alt="{html.escape(PLOTS[n][0])}">'
                     f"<figcaption>{html.escape(PLOTS[n][0])}</figcaption></figure>"
                     for n in drawn)
    skip = "".join(f"<li>{html.escape(PLOTS[n][0])}: {html.escape(why)}</li>"
                   for n, why in skipped.items())
    (out_dir / "index.html").write_text(
        "<!doctype html><meta charset=utf-8><title>molt report</title><style>body{font-family:"
        "sans-serif}figure{display:inline-block;margin:8px}img{max-width:700px}</style>"
        f"<h1>molt report: {html.escape(', '.join(runs))}</h1>\n{imgs}\n"
        + (f"<h2>Skipped</h2><ul>{skip}</ul>" if skip else ""))


def _label(path: Path, all_dirs: list[Path]) -> str:
    names = [d.name for d in all_dirs]
    return path.name if names.count(path.name) == 1 else str(path)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="", help="output folder (default: RUN_DIR/report for one run, "
                                             "report-<first run> beside it for several)")
    p.add_argument("--smoothing", type=float, default=0.6,
                   help="EMA weight in [0, 1) drawn over the faint raw series of "
                        f"{SMOOTH_MIN} points or more (0: raw only)")
    p.add_argument("--x", choices=["step", "time"], default="step",
                   help="x axis: training step or wall time in minutes")


def main(args: argparse.Namespace) -> int:
    if not 0 <= args.smoothing < 1:
        print(f"error: --smoothing {args.smoothing}: use a value in [0, 1)", file=sys.stderr)
        return 2
    first = Path(args.run_dirs[0])
    out = Path(args.out) if args.out else (first / "report" if len(args.run_dirs) == 1
                                           else first.parent / f"report-{first.name}")
    drawn, skipped = write_report(args.run_dirs, out, args.smoothing, args.x)
    print(f"report: {out / 'index.html'} ({len(drawn)} plots" + (
        "; skipped " + ", ".join(f"{n} ({why})" for n, why in skipped.items())
        if skipped else "") + ")")
    return 0
