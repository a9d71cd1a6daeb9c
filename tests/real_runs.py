"""Real tiny runs (`molt run` in a subprocess, the CPU toy recipe on a tiny model) for the code
that reads what a run writes: the metric sinks, `molt report`, `molt view`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import toy_recipe

TESTS = Path(__file__).parent


def molt(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m molt_tools ARGS` with its own short RAY_TMPDIR (Ray's socket paths)."""
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="rayrr", dir="/tmp"),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "molt_tools", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def real_run(root: Path, model: Path, *overrides: str, env: dict | None = None) -> Path:
    """A finished run of the toy recipe under `root/runs` (4x4 rollouts a step); its run dir."""
    root.mkdir(parents=True, exist_ok=True)
    recipe = toy_recipe(root, model)
    done = molt("run", recipe, f"out_dir={root / 'runs'}", "--no-progress", *overrides, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (root / "runs").iterdir()
    return run


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def history(run: Path) -> dict[str, list[tuple[int, float]]]:
    """What a sink should hold: key -> [(step, value)] of every namespaced number in
    metrics.jsonl (not the wall-clock `time`, nor the old flat names kept as aliases)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows(run):
        for k, v in row.items():
            if "/" in k and isinstance(v, (int, float)):
                out.setdefault(k, []).append((row["step"], v))
    return out


def saved_completions(run: Path) -> dict[int, list[tuple]]:
    """Per step, sorted (prompt, completion, reward) of the saved rollouts, decoded from the
    stored token ids (prompt: up to the first trainable token): what a sink's completions
    table should hold."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "final")
    out: dict[int, list[tuple]] = {}
    for f in sorted((run / "trajectories").glob("*.parquet")):
        for r in pq.read_table(f).to_pylist():
            cut = r["loss_mask"].index(True)
            out.setdefault(r["step"], []).append((
                tok.decode(r["token_ids"][:cut], skip_special_tokens=True),
                tok.decode(r["token_ids"][cut:], skip_special_tokens=True), r["reward"]))
    return {s: sorted(rows) for s, rows in out.items()}
