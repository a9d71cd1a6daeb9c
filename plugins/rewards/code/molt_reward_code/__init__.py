"""Sandboxed Python code-execution reward: run the response's code followed by the answer's tests.

The sandbox is built from what the OS offers (`isolation()`; `info["isolation"]` per call):
- `pid_ns`: its own PID namespace: it cannot see or signal the caller, and every descendant (a
  `setsid` grandchild too) dies with it; `net_ns`: a fresh network namespace (a down loopback);
- `mount_ns` (as root): the filesystem is read-only but its work dir, home directories (`/root`,
  `/home`, `$HOME`) are empty tmpfs (the interpreter's prefix is bound back in);
- `own_uid` (as root): a fresh unprivileged uid, so it can neither undo those mounts nor signal or
  read other users' processes and private files; RLIMIT_NPROC then counts only it;
- `cgroup` (as root, cgroup v1 `pids` + `memory`): process and memory limits on all of it together;
- always: rlimits (address space per process, CPU seconds, file size, no core dumps), a wall-clock
  timeout, an empty environment, `python -I`, a temp work dir deleted afterwards.

A harness runs the code, then the tests statement by statement, and reports over an inherited pipe
(with a nonce read from another): 1.0 only if it reported completing every test; exiting early
(`sys.exit(0)`, `os._exit(0)`) or killing itself fails.

Not protected against: a program that reads the nonce from the harness's frames or memory (they
share the interpreter: `sys._getframe(1).f_locals`, gc) could forge a pass; without root, the
filesystem and uid layers are missing (the program can read and write what the caller's user can,
RLIMIT_NPROC is unset), and without cgroups memory is bounded per process only (processes x
`memory_mb`). Files outside the home directories (e.g. /etc) stay readable. No kernel-exploit guard.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from molt_core import hookimpl

__all__ = ["code_reward", "extract_code", "isolation", "network_isolation_available"]

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_CGROUP = Path("/sys/fs/cgroup")

# Host side, before the namespaces: join the cgroups, then become `unshare ... python -c _SETUP`.
_LAUNCHER = """
import json, os, sys
cfg = json.loads(sys.argv[1])
for d in cfg["cgroups"]:
    with open(os.path.join(d, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
os.execvp(cfg["argv"][0], cfg["argv"])
"""

# PID 1 of the namespaces (still privileged there): mounts, limits, drop the uid, run the harness.
_SETUP = """
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
work = cfg["work"]
if cfg["mounts"]:
    libc = ctypes.CDLL(None, use_errno=True)
    def mount(src, target, fstype, flags, data=None):
        if libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), flags,
                      data and data.encode()) != 0:
            raise OSError(ctypes.get_errno(), "mount " + target)
    RDONLY, REMOUNT, BIND, MOVE, REC, PRIVATE = 1, 32, 4096, 8192, 16384, 1 << 18
    mount(None, "/", None, REC | PRIVATE)
    mount(work, work, None, BIND)
    keep, stage = cfg["keep"], os.path.join(work, ".prefix")
    if keep:
        os.mkdir(stage)
        mount(keep, stage, None, BIND | REC)
    for d in cfg["hide"]:
        mount("tmpfs", d, "tmpfs", 0, "mode=755")
    if keep:
        os.makedirs(keep, exist_ok=True)
        mount(stage, keep, None, MOVE)
        os.rmdir(stage)
    for line in open("/proc/self/mounts").read().splitlines():
        target = line.split()[1].replace("\\\\040", " ")
        if target != work:
            try:
                mount(None, target, None, REMOUNT | BIND | RDONLY)
            except OSError:
                pass
    os.chdir(work)
child = os.fork() if cfg["reaper"] else 0
while child:
    # PID 1 stays privileged and out of the program's reach: it reaps orphans until the harness
    # exits, then exits with its status (128 + signal), which ends the namespace.
    pid, status = os.wait()
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
for name, value in cfg["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value + (name == "RLIMIT_CPU")))
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
os.execv(cfg["python"], [cfg["python"], "-I", "-B", "harness.py", *cfg["fds"]])
"""

# The program's interpreter: the code, then the tests one statement at a time, reported over a
# pipe by this process only; what runs after the code is bound first (the code may patch builtins).
_HARNESS = """
import ast, os, sys
def main(run=exec, items=enumerate, write=os.write, pid=os.getpid):
    out, nonce_fd = (int(a) for a in sys.argv[1:3])
    nonce = os.read(nonce_fd, 64).decode()
    os.close(nonce_fd)
    me = pid()
    def report(msg):
        if pid() == me:
            write(out, f"{nonce} {msg}\\n".encode())
    tests = [compile(ast.Module([stmt], []), "tests.py", "exec")
             for stmt in ast.parse(open("tests.py").read()).body]
    ns = {"__name__": "__main__"}
    try:
        run(compile(open("solution.py").read(), "solution.py", "exec"), ns)
        for i, test in items(tests):
            run(test, ns)
            report(f"ok {i}")
    except SystemExit:
        report("exit")
        raise
    except BaseException:
        report("error")
        raise           # whatever is raised here ends main before "done"
    report(f"done {len(tests)}")
main()
"""


def extract_code(response: str) -> str:
    """The last fenced code block (```python ... ```), or the whole response if there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def isolation() -> frozenset[str]:
    """The sandbox layers available in this process (probed once)."""
    root = os.geteuid() == 0
    user = [] if root else ["-r"]
    out = set()
    if shutil.which("unshare"):
        if _works(["unshare", *user, "-pfm", "--kill-child", "--mount-proc", "true"]):
            out |= {"pid_ns", "mount_ns"} if root else {"pid_ns"}
        if _works(["unshare", *user, "-n", "true"]):
            out.add("net_ns")
    if root:
        out.add("own_uid")
        if all(os.access(_CGROUP / c, os.W_OK) for c in ("pids", "memory")):
            out.add("cgroup")
    return frozenset(out)


def network_isolation_available() -> bool:
    return "net_ns" in isolation()


class _Cgroups:
    """cgroup v1 `pids` + `memory` groups for one run: limits on all its processes together."""

    def __init__(self, name: str, max_processes: int, memory_bytes: int) -> None:
        self.dirs = [_CGROUP / "pids" / name, _CGROUP / "memory" / name]
        for d in self.dirs:
            d.mkdir()
        (self.dirs[0] / "pids.max").write_text(str(max_processes))
        (self.dirs[1] / "memory.limit_in_bytes").write_text(str(memory_bytes))

    def memory_hit(self) -> bool:
        return int((self.dirs[1] / "memory.failcnt").read_text()) > 0

    def close(self) -> None:
        for _ in range(200):
            pids = (self.dirs[0] / "cgroup.procs").read_text().split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            try:
                for d in self.dirs:
                    if d.exists():
                        d.rmdir()
                return
            except OSError:
                time.sleep(0.01)


def _hidden_homes() -> list[str]:
    homes = {os.path.realpath(p) for p in ("/root", "/home", os.environ.get("HOME", "/root"))}
    homes = {h for h in homes if os.path.isdir(h) and h != "/"}
    return sorted(h for h in homes if not any(h.startswith(o + "/") for o in homes))


def code_reward(response: str, answer: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
                max_output_kb: int = 256, max_processes: int = 16,
                isolate_network: bool = True) -> tuple[float, dict]:
    """1.0 if `extract_code(response)` runs and then every statement of `answer` (test code, e.g.
    asserts) completes, in the sandbox; `memory_mb` bounds each process (and all together with
    cgroups), `max_processes` the processes (with cgroups or as root).

    Otherwise 0.0 with `info["reason"]`: no_code, timeout, cpu_time_limit, memory_limit,
    process_limit, output_limit, early_exit, killed_by_signal, failed (then `info["error"]` is
    the last stderr line). `info["tests_passed"]`: test statements completed.
    """
    code = extract_code(response)
    if not code.strip():
        return 0.0, {"reason": "no_code"}
    layers = set(isolation()) - (set() if isolate_network else {"net_ns"})
    python = os.path.realpath(sys.executable)
    with tempfile.TemporaryDirectory(prefix="molt_code_") as tmp:
        d = Path(tmp)
        for name, text in (("solution.py", code), ("tests.py", answer), ("harness.py", _HARNESS)):
            (d / name).write_text(text)
        uid = 100_000 + secrets.randbelow(1_000_000) if "own_uid" in layers else None
        if uid is not None:
            for p in (d, *d.iterdir()):
                os.chown(p, uid, uid)
        rlimits = {"RLIMIT_AS": memory_mb * 2**20, "RLIMIT_CPU": max(1, int(timeout_s + 0.999)),
                   "RLIMIT_FSIZE": max_output_kb * 1024, "RLIMIT_CORE": 0}
        if uid is not None:
            rlimits["RLIMIT_NPROC"] = max_processes
        hide = [h for h in _hidden_homes() if not str(d).startswith(h + "/")] \
            if "mount_ns" in layers else []
        keep = next((sys.base_prefix for h in hide if sys.base_prefix.startswith(h + "/")), None)
        setup = {"work": str(d), "mounts": "mount_ns" in layers, "hide": hide, "keep": keep,
                 "reaper": "pid_ns" in layers, "rlimits": rlimits, "uid": uid, "python": python}
        t0 = time.perf_counter()
        rc, timed_out, memory_hit, mine = _launch(d, setup, layers, timeout_s, memory_mb,
                                                  max_processes)
        stdout = (d / "stdout").read_bytes()[-4096:].decode(errors="replace")
        stderr = (d / "stderr").read_bytes()[-4096:].decode(errors="replace")
    info = {"returncode": rc, "seconds": round(time.perf_counter() - t0, 3), "stdout": stdout,
            "stderr": stderr, "network_isolated": "net_ns" in layers,
            "isolation": sorted(layers), "tests_passed": sum(m.startswith("ok ") for m in mine)}
    done = any(m.startswith("done ") for m in mine)
    reason = _reason(rc, timed_out, stderr, memory_hit, done,
                     early="exit" in mine or (rc == 0 and not done))
    info["reason"] = reason
    if reason == "failed":
        lines = stderr.strip().splitlines()
        info["error"] = lines[-1] if lines else f"exit code {rc}"
    return float(reason == "passed"), info


def _launch(d: Path, setup: dict, layers: set[str], timeout_s: float, memory_mb: int,
            max_processes: int) -> tuple[int, bool, bool, list[str]]:
    """Run the harness in `d` under `setup`, in the namespaces and cgroups `layers` allows
    (cgroups that cannot be made are dropped from `layers`): (exit code, timed out, memory limit
    hit, the harness's reports that carry this run's nonce)."""
    results_r, results_w = os.pipe()
    nonce_r, nonce_w = os.pipe()
    nonce = secrets.token_hex(16)
    os.write(nonce_w, nonce.encode())
    os.close(nonce_w)
    python, user = setup["python"], [] if os.geteuid() == 0 else ["-r"]
    fds = {"fds": [str(results_w), str(nonce_r)]}
    argv = [python, "-I", "-c", _SETUP, json.dumps({**setup, **fds})]
    if "pid_ns" in layers:
        argv = ["unshare", *user, "--pid", "--fork", "--kill-child", "--mount-proc",
                *(["-n"] if "net_ns" in layers else []), *argv]
    elif "net_ns" in layers:
        argv = ["unshare", *user, "-n", *argv]
    cgroups = None
    if "cgroup" in layers:
        try:
            cgroups = _Cgroups(d.name, max_processes, memory_mb * 2**20)
        except OSError:          # e.g. a controller gone read-only: run without, and say so
            layers.discard("cgroup")
    launch = {"cgroups": [str(c) for c in cgroups.dirs] if cgroups else [], "argv": argv}
    try:
        with open(d / "stdout", "wb") as out, open(d / "stderr", "wb") as err:
            proc = subprocess.Popen([python, "-I", "-c", _LAUNCHER, json.dumps(launch)],
                                    cwd=d, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env={"PATH": os.defpath, "PYTHONHASHSEED": "0"},
                                    start_new_session=True, pass_fds=(results_w, nonce_r))
            os.close(results_w)
            os.close(nonce_r)
            try:
                rc = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)   # --kill-child: the namespace dies
            rc = proc.wait()
        if "pid_ns" in layers and rc > 128:        # the reaper's 128 + signal
            rc = 128 - rc
        memory_hit = cgroups is not None and cgroups.memory_hit()
    finally:
        if cgroups is not None:
            cgroups.close()
    reports = _read_all(results_r).decode(errors="replace").splitlines()
    return rc, timed_out, memory_hit, [r.split(" ", 1)[1] for r in reports
                                       if r.startswith(nonce + " ")]


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _reason(rc: int, timed_out: bool, stderr: str, memory_hit: bool, done: bool,
            early: bool) -> str:
    if timed_out:
        return "timeout"
    if rc == 0 and done:
        return "passed"
    if memory_hit or "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory_limit"
    if "BlockingIOError" in stderr or "Resource temporarily unavailable" in stderr:
        return "process_limit"
    if early:
        return "early_exit"
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
