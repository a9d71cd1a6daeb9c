"""Sandboxed Python code-execution reward: run the response's code followed by the answer's tests.

The sandbox is built from what the OS offers (`isolation()`; `info["isolation"]` per call): PID,
network and mount namespaces, a fresh uid, cgroup limits, rlimits, a wall-clock timeout, an empty
environment. The program holds no verdict: a judge process outside its namespaces runs the tests,
the program's names bound to handles that get data back; 1.0 only if the judge ran every test
statement. Each layer, the threat model and what is not protected: docs/environments.md,
"The code sandbox"."""

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

# Values between the interpreters: trees of literals; other objects stay put, as handles ("r", n).
_CODEC = """
import ast, collections, os, sys
KINDS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
def enc(v, ref):
    if v is None or type(v) in (bool, int, str, bytes):
        return ("v", v)
    if isinstance(v, float):
        return ("f", repr(float(v)))
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return ("nt", (type(v).__name__, v._fields, [enc(x, ref) for x in v]))
    if isinstance(v, dict):
        return ("dict", [(enc(k, ref), enc(x, ref)) for k, x in v.items()])
    kind = next((k for k, t in KINDS.items() if isinstance(v, t)), None)
    return (kind, [enc(x, ref) for x in v]) if kind else ("r", ref(v))
def dec(v, unref):
    kind, x = v
    if kind == "dict":
        return {dec(k, unref): dec(y, unref) for k, y in x}
    if kind in KINDS:
        return KINDS[kind](dec(y, unref) for y in x)
    if kind == "nt":
        return collections.namedtuple(*x[:2])(*(dec(y, unref) for y in x[2]))
    return {"v": lambda x: x, "f": float, "r": unref}[kind](x)
"""

# The program's interpreter: the code, its names, then an answer to each of the judge's requests.
_PROGRAM = _CODEC + """
req, resp = os.fdopen(int(sys.argv[1])), os.fdopen(int(sys.argv[2]), "w", buffering=1)
objs, ns, literal = [], {"__name__": "__main__"}, ast.literal_eval
ref = lambda v: objs.append(v) or len(objs) - 1
exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
print(repr({k: enc(v, ref) if type(v) in (bool, int, float, str, bytes, type(None)) else
            ("r", ref(v)) for k, v in ns.items() if not k.startswith("__")}), file=resp)
ops = {"call": lambda o, *a, **k: o(*a, **k), "getattr": getattr, "getitem": lambda o, k: o[k],
       "iter": list, "len": len, "bool": bool, "str": str, "eq": lambda o, x: o == x,
       "contains": lambda o, x: x in o, "value": lambda o: o}
for line in req:
    try:
        op, obj, args, kwargs = dec(literal(line), objs.__getitem__)
        out = ("ok", enc(ops[op](obj, *args, **kwargs), ref))
    except Exception as e:
        out = ("err", type(e).__name__, str(e))
    print(repr(out), file=resp)
"""

# The tests' interpreter, out of the program's reach: the program's names (not builtins) as handles.
_JUDGE = _CODEC + """
import builtins, contextlib, functools, resource
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[3]),) * 2)
say, sys.stdout = functools.partial(print, file=sys.stdout, flush=True), sys.stderr
req, resp = open(int(sys.argv[1]), "w", buffering=1), open(int(sys.argv[2]))
def ref(v):
    if not isinstance(v, Remote):
        raise TypeError(f"a test can pass the program only data or its own objects, not {v!r}")
    return v._ref
def reply():
    if not (line := resp.readline()):
        resp.close()      # the program is gone; whatever a test catches, the verdict says so
    return ast.literal_eval(line)
def ask(obj, op, *args, **kwargs):
    with contextlib.suppress(BrokenPipeError):
        print(repr(enc((op, obj, args, kwargs), ref)), file=req)
    kind, *out = reply()
    if kind == "ok":
        return dec(out[0], Remote)
    cls = getattr(builtins, out[0], None)
    raise cls(out[1]) if isinstance(cls, type) and issubclass(cls, Exception) else \\
        RuntimeError(": ".join(out))
class Remote:
    def __init__(self, ref):
        self._ref = ref
    def __getattr__(self, name):
        return ask(self, "getattr", name)
    def __eq__(self, other):        # against data: its value, if data, compared here
        if isinstance(other, Remote):
            return ask(self, "eq", other)
        mine = ask(self, "value")
        return NotImplemented if isinstance(mine, Remote) else mine == other
    __hash__ = object.__hash__
    __iter__ = lambda self: iter(ask(self, "iter"))
for op in ("call", "getitem", "len", "bool", "str", "contains"):
    setattr(Remote, f"__{op}__", functools.partialmethod(ask, op))
try:
    tests = ast.parse(sys.stdin.read()).body
    ns = {k: dec(v, Remote) for k, v in reply().items() if k not in vars(builtins)}
    ns["__name__"] = "__main__"
    for stmt in tests:
        exec(compile(ast.Module([stmt], []), "tests.py", "exec"), ns)
        say("gone" if resp.closed else "ok")
    say("gone" if resp.closed else "done")
except BaseException as e:
    say("gone" if resp.closed else "fail", f"{type(e).__name__}: {e}".removesuffix(": "))
"""


def extract_code(response: str) -> str:
    """The last fenced code block (```python ... ```), or the whole response if there is none."""
    return blocks[-1] if (blocks := _FENCE.findall(response)) else response


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
            for pid in (self.dirs[0] / "cgroup.procs").read_text().split():
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
    """1.0 if `extract_code(response)` runs in the sandbox and then the judge runs every statement
    of `answer` (test code, e.g. asserts); else 0.0 with `info["reason"]` (the reasons and limits:
    docs/environments.md, "The code sandbox")."""
    if not (code := extract_code(response)).strip():
        return 0.0, {"reason": "no_code"}
    layers = set(isolation()) - (set() if isolate_network else {"net_ns"})
    python = os.path.realpath(sys.executable)
    with tempfile.TemporaryDirectory(prefix="molt_code_") as tmp:
        d = Path(tmp)
        for name, text in (("solution.py", code), ("harness.py", _PROGRAM)):
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
        rc, timed_out, memory_hit, verdict, stdout, stderr = _launch(
            d, setup, answer, layers, timeout_s, memory_mb, max_processes)
    passed = next(i for i, line in enumerate(verdict.split("\n") + [""]) if line != "ok")
    status, _, failure = verdict.split("\n", passed)[-1].strip().partition(" ")
    info = {"returncode": rc, "seconds": round(time.perf_counter() - t0, 3), "stdout": stdout,
            "stderr": stderr, "network_isolated": "net_ns" in layers,
            "isolation": sorted(layers), "tests_passed": passed}
    info["reason"] = reason = _reason(rc, timed_out, stderr + failure, memory_hit, status)
    if reason == "failed":
        lines = stderr.strip().splitlines()
        info["error"] = failure if status == "fail" else lines[-1] if lines else f"exit code {rc}"
    return float(reason == "passed"), info


def _launch(d: Path, setup: dict, tests: str, layers: set[str], timeout_s: float,
            memory_mb: int, max_processes: int) -> tuple[int, bool, bool, str, str, str]:
    """Run the program in `d` under `setup`, in the namespaces and cgroups `layers` allows
    (cgroups that cannot be made are dropped from `layers`), and the judge of `tests` beside it:
    (the program's exit code, timed out, memory limit hit, the judge's verdict lines, the last
    4 KB of its stdout and stderr)."""
    (req_r, req_w), (resp_r, resp_w) = os.pipe(), os.pipe()
    python, user = setup["python"], [] if os.geteuid() == 0 else ["-r"]
    argv = [python, "-I", "-c", _SETUP, json.dumps({**setup, "fds": [str(req_r), str(resp_w)]})]
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
    env = {"PATH": os.defpath, "PYTHONHASHSEED": "0"}
    try:
        # unnamed files outside `d`: the host never opens a path the program can swap for a link
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                tempfile.TemporaryFile() as test_file, tempfile.TemporaryFile("w+") as verdict:
            test_file.write(tests.encode())
            test_file.seek(0)
            procs = [subprocess.Popen([python, "-I", "-c", _JUDGE, str(req_w), str(resp_r),
                                       str(memory_mb * 2**20)], stdin=test_file, stdout=verdict,
                                      stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                                      pass_fds=(req_w, resp_r)),
                     subprocess.Popen([python, "-I", "-c", _LAUNCHER, json.dumps(launch)],
                                      cwd=d, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                      env=env, start_new_session=True, pass_fds=(req_r, resp_w))]
            for fd in (req_r, req_w, resp_r, resp_w):
                os.close(fd)
            deadline, timed_out = time.monotonic() + timeout_s, False
            try:
                for proc in procs:       # the judge ends first, then the program (its input ends)
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                for proc in procs:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)   # --kill-child: the namespace dies
            rc = [proc.wait() for proc in procs][1]
            verdict.seek(0)
            lines = verdict.read()
            for f in (out, err):
                f.seek(0)
            outputs = [f.read()[-4096:].decode(errors="replace") for f in (out, err)]
        if "pid_ns" in layers and rc > 128:        # the reaper's 128 + signal
            rc = 128 - rc
        memory_hit = cgroups is not None and cgroups.memory_hit()
    finally:
        if cgroups is not None:
            cgroups.close()
    return rc, timed_out, memory_hit, lines, *outputs


def _reason(rc: int, timed_out: bool, stderr: str, memory_hit: bool, status: str) -> str:
    if status == "done":
        return "passed"
    if timed_out:
        return "timeout"
    if memory_hit or "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory_limit"
    if "BlockingIOError" in stderr or "Resource temporarily unavailable" in stderr:
        return "process_limit"
    if status == "fail":
        return "failed"
    if rc == 0:
        return "early_exit"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL) and "Traceback" not in stderr:
        return "cpu_time_limit" if rc == -signal.SIGXCPU else "killed_by_signal"
    if rc == -signal.SIGXFSZ or "File too large" in stderr:
        return "output_limit"
    return "killed_by_signal" if rc < 0 else "failed"


@hookimpl
def molt_rewards() -> dict:
    return {"code": code_reward}
