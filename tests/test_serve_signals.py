"""`molt serve` as a user runs it (its own process, its own local Ray): SIGTERM stops it cleanly,
as Ctrl-C does (issue 25 item 10): exit 0, the session's trajectory saved, no Ray crash dump."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai


def test_sigterm_stops_molt_serve_cleanly(tiny_recipe, tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="rayserve", dir="/tmp")
    proc = subprocess.Popen([sys.executable, "-m", "molt_tools", "serve", tiny_recipe,
                             f"out_dir={tmp_path}"], env={**os.environ, "RAY_TMPDIR": ray_tmp},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = []
        for line in proc.stdout:            # the banner: URLs and key, once serving
            lines.append(line)
            if "api_key:" in line:
                break
        found = {k.strip(): v.strip() for k, _, v in (ln.partition(": ") for ln in lines)}
        client = openai.OpenAI(base_url=found["OpenAI base_url"], api_key=found["api_key"],
                               max_retries=0, timeout=120)
        r = client.chat.completions.create(model="p", max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "saved " in out and r.usage.completion_tokens >= 1
    for noise in ("Traceback", "SIGABRT", "*** ", "Aborted", "core dumped"):
        assert noise not in err, err[-3000:]


# A wrapper (uv run, make, a shell with a trap) that forwards SIGTERM to its child, a moment late
_FORWARD = """import signal, subprocess, sys, time
child = subprocess.Popen(sys.argv[1:])
def forward(sig, _):
    time.sleep(0.3)
    child.send_signal(sig)
signal.signal(signal.SIGTERM, forward)
sys.exit(child.wait())"""


def test_timeout_stops_a_chat_agent_run_once_with_a_checkpoint(tiny_model_dir, tmp_path):
    """GNU timeout signals the run and its process group, and the wrapper in between forwards
    its own: one stop request (issue 41 item 10). The step ends, a checkpoint is saved (with the
    default save_every 0), the chat server closes quietly."""
    import yaml
    from molt_core.run import checkpoint
    recipe = yaml.safe_load(open(Path(__file__).parents[1] / "recipes/cpu/chat_calculator.yaml"))
    recipe.update(model={"path": str(tiny_model_dir)}, out_dir=str(tmp_path / "runs"))
    recipe["rollout"].update(groups_per_step=2, group_size=2)
    recipe["trainer"].update(steps=500)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    proc = subprocess.Popen(["timeout", "3000", sys.executable, "-c", _FORWARD, sys.executable,
                             "-m", "molt_tools", "run", str(tmp_path / "recipe.yaml"),
                             "--no-progress"], text=True, stderr=subprocess.PIPE,
                            env={**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(dir="/tmp")})
    try:
        for _ in range(2400):             # a hang guard, not a speed check
            if proc.poll() is not None or (found := list((tmp_path / "runs").glob(
                    "*/metrics.jsonl"))) and found[0].read_text().count("\n") >= 1:
                break
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # to timeout: as when its time is up
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    run = found[0].parent
    assert checkpoint.latest(run) is not None and "stopped" in err, err[-3000:]
    for noise in ("Traceback", "second SIGTERM", "graceful shutdown"):
        assert noise not in err, err[-3000:]
