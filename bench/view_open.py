"""How fast `molt view` of a 1,000-step run opens in headless Chromium, from a copied run dir.

The run is synthetic: realistic toy-agent rollouts (8 groups x 8 rollouts a step, 1-3 turns
with tool feedback between them, 2-step async lag, trainer log-probs near the engine's) built
as `Trajectory` objects over the CPU recipe's character tokenizer and saved by the real
`TrajectoryWriter` (a file per 10 steps, as its 10 s flush makes of ~1 s steps). A real
1,000-step training run would cost the shared box an hour of CPU for the same files.

    .venv/bin/python bench/view_open.py [--steps 1000] [--run-dir DIR] [--shot /tmp/molt-view-open.png]

Prints the time `molt view` takes to write the pages, their sizes, and per browser start the
page's own `performance.now()` at its first render (index and first step drawn) plus the wall
time of the whole headless Chromium process (start-up included).
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from molt_core.run.trajectory_store import TrajectoryWriter
from molt_core.trajectory import Completion, Trajectory
from molt_tools.tiny import CHARSET, build_char_tokenizer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TOOLS = ["calc", "search", "python"]


class _TrainedLogprobs:
    """Stands in for the trainer's policy: its pre-update log-probs, one row per segment."""

    def __init__(self, trajs: list[Trajectory], rng: random.Random) -> None:
        rows = [torch.tensor(t.logprobs) + torch.tensor(
            [rng.gauss(0, 0.02) if m else 0.0 for m in t.loss_mask]) for t in trajs]
        self.lp = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    def trained_logprobs(self) -> torch.Tensor:
        return self.lp


def rollout(tok, step: int, group: int, rid: int, rng: random.Random) -> Trajectory:
    """One toy-agent rollout: a task, 1-3 policy turns, a tool result after each but the last."""
    ids = lambda s: tok(s, add_special_tokens=False).input_ids     # noqa: E731
    skill = min(1.0, step / 800)
    turns = rng.choice([1, 2, 2, 3])
    t = Trajectory(group, rid, reward=0.0, turn_rewards=[])
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    t.add_prompt(ids(f"task {group}: what is {a}*{b}? use a tool, then answer. "))
    for k in range(turns):
        last = k == turns - 1
        text = (f"answer: {a * b if rng.random() < 0.2 + 0.7 * skill else a * b + 1}." if last
                else f"call {rng.choice(TOOLS)}({a}*{b}) " + "hmm " * rng.randint(0, 12))
        version = max(0, step - rng.choice([0, 1, 1, 2]))
        toks = ids(text)
        t.add_completion(Completion(toks, [-abs(rng.gauss(0.3, 0.4)) for _ in toks],
                                    [version] * len(toks)))
        t.turn_rewards.append(float(last and text.startswith(f"answer: {a * b}.")))
        if not last:
            t.add_prompt(ids(f" result: {a * b} "))
    t.reward = sum(t.turn_rewards) + rng.gauss(0, 0.05)
    return t


def build_run(run_dir: Path, steps: int, groups: int = 8, size: int = 8) -> None:
    tok = build_char_tokenizer(CHARSET)
    tok.save_pretrained(run_dir / "final")
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"path": ".cache/tiny-chars"}}))
    rng = random.Random(0)
    writer = TrajectoryWriter(run_dir, tok)
    for step in range(steps):
        trajs = [rollout(tok, step, g, r, rng) for g in range(groups) for r in range(size)]
        writer.write(step, trajs, _TrainedLogprobs(trajs, rng))
        if step % 10 == 9:
            writer.flush()
    writer.flush()
    writer.close()


def open_page(url: str, shot: Path | None = None) -> tuple[dict[str, float], float, str]:
    """(the page's own clock, ms after navigation: its script started, the index drawn, the
    first step drawn; the whole Chromium process in s; the DOM without its scripts)."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--window-size=1400,900"]
    t0 = time.perf_counter()
    dom = subprocess.run([*args, "--dump-dom", url],      # after the load event (step included)
                         capture_output=True, text=True, timeout=120, check=True).stdout
    wall = time.perf_counter() - t0
    if shot:
        subprocess.run([*args, f"--screenshot={shot}", "--virtual-time-budget=5000", url],
                       capture_output=True, timeout=120, check=True)
    times = {k: float(v) for k, v in re.findall(r'data-(script|index|rendered)="([\d.]+)"', dom)}
    return times, wall, re.sub(r"<script.*?</script>", "", dom, flags=re.S)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--run-dir", default="", help="an existing run dir (else one is built)")
    p.add_argument("--shot", default="/tmp/molt-view-open.png")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="molt-view-bench-"))
    src = Path(args.run_dir) if args.run_dir else tmp / "built"
    if not args.run_dir:
        t0 = time.perf_counter()
        build_run(src, args.steps)
        print(f"built {args.steps} steps with the real writer in {time.perf_counter() - t0:.1f} s")
    run = tmp / "copied" / src.name
    shutil.copytree(src, run)
    parquet = sum(f.stat().st_size for f in (run / "trajectories").glob("*.parquet"))
    t0 = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "molt"), "view", str(run)], check=True,
                   cwd=tmp)
    print(f"molt view (from another directory): {time.perf_counter() - t0:.1f} s")
    view = run / "view"
    steps = sorted((view / "steps").glob("*.js"))
    index = (view / "index.html").stat().st_size
    print(f"parquet {parquet / 1e6:.1f} MB; index.html {index / 1e3:.0f} kB; {len(steps)} step "
          f"files, {sum(f.stat().st_size for f in steps) / 1e6:.1f} MB in all, largest {max(f.stat().st_size for f in steps) / 1e3:.0f} kB")
    url = (view / "index.html").as_uri()
    for k, query in enumerate(["", "", "", "?step=999&rmin=0.5&gap=0.07&colour=gap"]):
        t, wall, dom = open_page(url + query, Path(args.shot) if k == 0 else None)
        drawn = dom.count('class="rollout"')
        print(f"open {k} {query or '(first step)'}: ms after navigation: script "
              f"{t.get('script', 0):.0f}, index drawn {t.get('index', 0):.0f}, step drawn "
              f"{t.get('rendered', float('nan')):.0f} ({drawn} rollouts);"
              f" chromium process {wall:.2f} s (start-up and exit included)")
    print(f"screenshot: {args.shot}")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
