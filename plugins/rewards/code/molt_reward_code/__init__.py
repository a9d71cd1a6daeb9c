"""Sandboxed Python code-execution reward: run the response's code followed by the answer's tests.

The program runs in a child process that cannot hurt the caller:
- its own temp dir (cwd, deleted afterwards), empty environment, stdin closed, `python -I`;
- rlimits set by a launcher that then `exec`s the program (no `preexec_fn`, which is unsafe in a
  threaded caller): address space (`memory_mb`), CPU seconds, file size (`max_output_kb`, which
  also bounds stdout/stderr, written to files rather than pipes), no core dumps;
- a wall-clock timeout, after which the whole process group is killed;
- no network: the child runs in a fresh network namespace (`unshare -rn`: only a down loopback)
  when the kernel allows unprivileged user namespaces; otherwise it runs with the host network and
  `info["network_isolated"]` is False (run the trainer in a container without network then).
Not a security boundary against a determined attacker (same user, same filesystem); it contains
the mistakes a policy makes: infinite loops, memory bombs, huge outputs, stray sockets.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from molt_core import hookimpl

__all__ = ["code_reward", "extract_code", "network_isolation_available"]

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# Runs inside the child: set limits on itself, then become the program.
_LAUNCHER = """
import os, resource, sys
mem, cpu, fsize = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", sys.argv[4]])
"""


def extract_code(response: str) -> str:
    """The last fenced code block (```python ... ```), or the whole response if there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


@functools.cache
def network_isolation_available() -> bool:
    """Whether `unshare -rn` works here (probed once per process)."""
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def code_reward(response: str, answer: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
                max_output_kb: int = 256, isolate_network: bool = True) -> tuple[float, dict]:
    """1.0 if `extract_code(response)` followed by `answer` (test code, e.g. asserts) exits 0.

    Otherwise 0.0 with `info["reason"]`: no_code, timeout, cpu_time_limit, memory_limit,
    output_limit, killed_by_signal, failed (then `info["error"]` is the last stderr line).
    """
    code = extract_code(response)
    if not code.strip():
        return 0.0, {"reason": "no_code"}
    netns = isolate_network and network_isolation_available()
    with tempfile.TemporaryDirectory(prefix="molt_code_") as tmp:
        d = Path(tmp)
        (d / "main.py").write_text(f"{code}\n\n{answer}\n")
        limits = [str(memory_mb * 2**20), str(max(1, int(timeout_s + 0.999))),
                  str(max_output_kb * 1024), "main.py"]
        cmd = [*(["unshare", "-rn"] if netns else []), sys.executable, "-I", "-c", _LAUNCHER,
               *limits]
        t0 = time.perf_counter()
        with open(d / "stdout", "wb") as out, open(d / "stderr", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=d, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env={"PATH": os.defpath, "PYTHONHASHSEED": "0"},
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)            # also reaps anything the program left behind
            rc = proc.wait()
        stdout = (d / "stdout").read_bytes()[-4096:].decode(errors="replace")
        stderr = (d / "stderr").read_bytes()[-4096:].decode(errors="replace")
    info = {"returncode": rc, "seconds": round(time.perf_counter() - t0, 3), "stdout": stdout,
            "stderr": stderr, "network_isolated": netns}
    reason = _reason(rc, timed_out, stderr)
    info["reason"] = reason
    if reason == "failed":
        lines = stderr.strip().splitlines()
        info["error"] = lines[-1] if lines else f"exit code {rc}"
    return float(reason == "passed"), info


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reason(rc: int, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if rc == 0:
        return "passed"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory_limit"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL) and "Traceback" not in stderr:
        return "cpu_time_limit" if rc == -signal.SIGXCPU else "killed_by_signal"
    if rc == -signal.SIGXFSZ or "File too large" in stderr:
        return "output_limit"
    if rc < 0:
        return "killed_by_signal"
    return "failed"


@hookimpl
def molt_rewards() -> dict:
    return {"code": code_reward}
