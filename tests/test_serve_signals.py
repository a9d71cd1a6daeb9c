"""`molt serve` as a user runs it (its own process, its own local Ray): SIGTERM stops it cleanly,
as Ctrl-C does (issue 25 item 10): exit 0, the session's trajectory saved, no Ray crash dump."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

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
