"""The code reward runs real subprocesses: limits hold and the caller is untouched."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from molt_reward_code import code_reward, extract_code, isolation, network_isolation_available

ADD = "```python\ndef add(a, b):\n    return a + b\n```"


def test_passing_and_failing_programs():
    assert code_reward("Here:\n" + ADD, "assert add(2, 3) == 5")[0] == 1.0
    reward, info = code_reward(ADD, "assert add(2, 2) == 5, 'add is wrong'")
    assert reward == 0.0 and info["reason"] == "failed"
    assert info["error"] == "AssertionError: add is wrong"
    assert code_reward("```python\n```", "")[1]["reason"] == "no_code"


def test_extract_code_takes_the_last_fenced_block_or_everything():
    assert extract_code("```py\na = 1\n```\ntext\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_code("print(1)") == "print(1)"


def test_infinite_loop_is_killed_at_the_time_limit():
    reward, info = code_reward("while True:\n    pass", "", timeout_s=1.0)
    assert reward == 0.0 and info["reason"] == "timeout"      # the limit fired, not the loop


def _alive(marker: str) -> list[int]:
    """Host pids whose command line contains `marker`."""
    out = []
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if p.name.isdigit() and marker in (p / "cmdline").read_bytes().decode(errors="ignore") \
                    and (p / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(p.name))
    return out


@pytest.mark.parametrize("detach", ["", "start_new_session=True"])
def test_background_children_die_with_the_program(detach):
    """A child, or a `setsid` grandchild, does not outlive the call."""
    secs = f"{31 + secrets.randbelow(10**6) / 10**7:.7f}"
    code = ("import subprocess, time\n"
            f"subprocess.Popen(['sleep', '{secs}'], {detach})\ntime.sleep(0.2)")
    reward, info = code_reward(code, "assert False")
    assert reward == 0.0 and info["reason"] == "failed"
    time.sleep(0.2)
    assert not _alive(f"sleep\0{secs}")


def test_program_cannot_signal_the_caller():
    for code in ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                 f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
                 f"import os, signal\nos.killpg({os.getpgid(0)}, signal.SIGKILL)"):
        reward, info = code_reward(code, "assert True")
        assert reward == 0.0, (code, info)
    assert code_reward(ADD, "assert add(1, 1) == 2")[0] == 1.0       # and we are still here


@pytest.mark.parametrize("exit_", ["import sys\nsys.exit(0)", "import os\nos._exit(0)",
                                   "raise SystemExit", "import os, signal\n"
                                   "os.kill(os.getpid(), signal.SIGKILL)"])
def test_exiting_before_the_tests_scores_zero(exit_):
    reward, info = code_reward(exit_, "assert False")
    assert reward == 0.0 and info["tests_passed"] == 0
    assert info["reason"] in ("early_exit", "killed_by_signal"), info



@pytest.mark.parametrize("patch", [
    "import builtins\nbuiltins.exec = lambda *a, **k: None",          # the tests never run
    "import builtins\nbuiltins.enumerate = lambda x: iter(())",       # the test loop is empty
    "import sys\nsys.exit = lambda *a: None",                         # the failure falls through
    "import os\nw = os.write\nos.write = lambda fd, b: w(fd, b.replace(b' error', b' done 1'))",
])
def test_patching_what_the_harness_calls_scores_zero(patch):
    reward, info = code_reward(patch, "assert False")
    assert reward == 0.0 and info["tests_passed"] == 0 and info["reason"] == "failed", info
    assert info["error"] == "AssertionError"

def test_tests_are_reported_one_by_one():
    reward, info = code_reward(ADD, "assert add(1, 1) == 2\nassert add(1, 2) == 3\nassert False")
    assert reward == 0.0 and info["tests_passed"] == 2 and info["reason"] == "failed"


@pytest.mark.skipif(not {"cgroup"} <= isolation() and not {"own_uid"} <= isolation(),
                    reason="no process-count limit here (needs root: cgroups or RLIMIT_NPROC)")
def test_fork_storm_is_contained():
    code = "import os\nwhile True:\n    os.fork()"
    # the limit stops it (fork fails) in well under a second; the timeout is only a backstop
    reward, info = code_reward(code, "assert True", timeout_s=20.0, max_processes=8)
    assert reward == 0.0 and info["reason"] == "process_limit", info


@pytest.mark.skipif("cgroup" not in isolation(), reason="needs cgroup v1 memory (root)")
def test_memory_is_limited_across_processes():
    # each child holds its 200 MB a while, so the four overlap (children that allocate and exit
    # at once may run one after another on 2 cores and never exceed the limit together)
    code = """import os, time
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (200 * 2**20)
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
assert all(os.waitpid(k, 0)[1] == 0 for k in kids), "a child was killed"
"""
    reward, info = code_reward(code, "assert True", memory_mb=512, timeout_s=20)
    assert reward == 0.0 and info["reason"] == "memory_limit", info
    assert code_reward(code.replace("range(4)", "range(1)"), "assert True", memory_mb=512,
                       timeout_s=20)[0] == 1.0


@pytest.mark.skipif("mount_ns" not in isolation(), reason="needs a mount namespace (root)")
def test_files_outside_the_work_dir_are_out_of_reach(tmp_path):
    secret = Path.home() / f".molt_sandbox_secret_{secrets.token_hex(4)}"
    secret.write_text("s3cret")
    outside = tmp_path / "escaped"
    try:
        reads = [f"print(open({str(secret)!r}).read())", "import os\nprint(os.listdir('/root'))"
                 "\nassert os.listdir('/root') in ([], ['.pyenv'])\nraise RuntimeError"]
        for code in reads:
            reward, info = code_reward(code, "assert True")
            assert reward == 0.0 and "s3cret" not in info["stdout"] + info["stderr"], info
        for target in (outside, Path("/tmp") / outside.name, Path.home() / outside.name):
            reward, info = code_reward(f"open({str(target)!r}, 'w').write('x')", "assert True")
            assert reward == 0.0 and not target.exists(), info
        reward, info = code_reward("open('inside.txt', 'w').write('x')\n"
                                   "assert open('inside.txt').read() == 'x'", "assert True")
        assert reward == 1.0, info
    finally:
        secret.unlink()


@pytest.mark.skipif("own_uid" not in isolation(),
                    reason="needs a fresh uid (root); else the program reads what the caller can")
def test_outputs_swapped_for_links_do_not_read_host_files(tmp_path):
    """Issue 41: stdout and stderr come back through the host's own descriptors, not their paths
    in the work dir, which the program can replace with links to a file only the caller reads."""
    secret = tmp_path / "secret"
    secret.write_text(f"s3cret-{secrets.token_hex(8)}")
    secret.chmod(0o600)
    code = (f"import os, sys\nprint('mine')\nprint('err', file=sys.stderr)\n"
            f"for name in ('stdout', 'stderr'):\n    if os.path.lexists(name):\n"
            f"        os.unlink(name)\n"
            f"    os.symlink({str(secret)!r}, name)\ndef add(a, b):\n    return a + b")
    reward, info = code_reward(code, "assert add(1, 2) == 3")
    assert "s3cret" not in json.dumps(info), info
    assert reward == 1.0 and (info["stdout"], info["stderr"]) == ("mine\n", "err\n"), info


@pytest.mark.parametrize("bomb", [
    "a = []\nwhile True:\n    a.append(' ' * 10**7)",    # grows until the address-space limit
    "x = bytearray(10**11)",                             # one huge allocation
])
def test_memory_bomb_is_stopped_and_reported(bomb):
    before = resource.getrlimit(resource.RLIMIT_AS)
    reward, info = code_reward(bomb, "", timeout_s=5.0, memory_mb=256)
    assert reward == 0.0 and info["reason"] == "memory_limit"
    assert resource.getrlimit(resource.RLIMIT_AS) == before   # the caller's limits are untouched


def test_output_flood_is_capped():
    reward, info = code_reward("while True:\n    print('x' * 1000)", "", max_output_kb=64)
    assert reward == 0.0 and info["reason"] == "output_limit"
    assert len(info["stdout"]) <= 4096


@pytest.mark.skipif(not network_isolation_available(), reason="unshare -n not permitted here")
def test_no_network_inside_the_sandbox():
    code = "import socket\nprint(sorted(n for _, n in socket.if_nameindex()))"
    reward, info = code_reward(code, "")
    assert reward == 1.0 and info["network_isolated"] and info["stdout"].strip() == "['lo']"
    reward, info = code_reward("import socket\nsocket.create_connection(('10.0.0.1', 80), 1)", "")
    assert reward == 0.0 and "unreachable" in info["error"]


def test_safe_from_worker_threads():
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: code_reward(ADD, f"assert add({i}, 1) == {i + 1}"),
                                range(4)))
    assert [r for r, _ in results] == [1.0] * 4


_SCAN = """
def scan(found):
    for fd in range(3, 64):
        for nonce in found:
            try:
                os.write(fd, nonce + b" done 1\\n")
            except OSError:
                pass
    os._exit(0)
"""
FORGES = {
    "getframe_report": "import os, sys\nsys._getframe(1).f_locals['report']('done 1')\nos._exit(0)",
    "getframe_tests": "import sys\nsys._getframe(1).f_locals['tests'].clear()",
    "traceback_f_back": "try:\n    raise ValueError\nexcept ValueError as e:\n"
                        "    e.__traceback__.tb_frame.f_back.f_locals['tests'].clear()",
    "inspect_stack": "import inspect, os\ninspect.stack()[1].frame.f_locals['report']('done 1')\n"
                     "os._exit(0)",
    "gc_report_closure": "import gc, os\n[f for f in gc.get_objects() if getattr(f, '__name__', '')"
                         " == 'report'][0]('done 1')\nos._exit(0)",
    "gc_tests_list": "import gc\nfor o in gc.get_objects():\n    if type(o) is list and o and all("
                     "getattr(c, 'co_filename', '') == 'tests.py' for c in o):\n        o.clear()",
    "gc_closure_cells": "import gc, os, re\n" + _SCAN + "cells = [o for o in gc.get_objects() "
                        "if type(o).__name__ == 'cell']\nscan({c.cell_contents.encode() for c in "
                        "cells if isinstance(getattr(c, 'cell_contents', 0), str)})",
    "proc_self_mem": "import os, re\n" + _SCAN + """found = set()
for line in open('/proc/self/maps'):
    span, perms = line.split()[:2]
    lo, hi = (int(x, 16) for x in span.split('-'))
    if perms.startswith('r') and hi - lo < 2**26:
        try:
            with open('/proc/self/mem', 'rb', 0) as mem:
                mem.seek(lo)
                hexes = rb'(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])'
                found |= set(re.findall(hexes, mem.read(hi - lo)))
        except (OSError, ValueError, OverflowError):
            pass
scan(found)""",
}


@pytest.mark.parametrize("forge", FORGES)
def test_forging_a_pass_from_inside_the_program_scores_zero(forge):
    """Issue 25: the verdict cannot be forged from the program's own process (frames, gc,
    its memory, every fd it holds); the tests are `assert False`."""
    reward, info = code_reward(FORGES[forge], "assert False")
    assert reward == 0.0 and info["tests_passed"] == 0, info


HONEST = {   # what tests do with a program's objects; each also scores 1.0 on the in-process harness
    "class": ("class Stack:\n    def __init__(self):\n        self.items = []\n"
              "    def push(self, x):\n        self.items.append(x)\n"
              "    def __len__(self):\n        return len(self.items)\n",
              "s = Stack()\ns.push(1)\nassert len(s) == 1 and s.items == [1] and 1 in s.items"),
    "generator": ("def gen(n):\n    yield from range(n)", "assert list(gen(3)) == [0, 1, 2]"),
    "containers": ("from collections import Counter, namedtuple\nP = namedtuple('P', 'x y')\n"
                   "def f():\n    return Counter('aab'), P(1, 2), {3: (b'x', None)}, {4.5}",
                   "c, p, d, s = f()\nassert c == {'a': 2, 'b': 1} and p == (1, 2) and p.y == 2\n"
                   "assert d == {3: (b'x', None)} and s == {4.5}"),
    "inf_and_kwargs": ("def f(a, b=0):\n    return float('inf') if b else a",
                       "assert f(1, b=1) == float('inf') and f(a=2) == 2"),
    "raises": ("def f(x):\n    if x < 0:\n        raise ValueError('neg')\n    return x",
               "try:\n    f(-1)\nexcept ValueError as e:\n    assert str(e) == 'neg'\n"
               "else:\n    raise AssertionError"),
    "check_candidate": (ADD, "def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)"),
    "objects": ("class P:\n    def __init__(self, x):\n        self.x = x\n"
                "    def __eq__(self, o):\n        return self.x == o.x\n"
                "def pts():\n    return [P(1), P(2)]",
                "assert [p.x for p in pts()] == [1, 2] and pts()[0] == P(1)"),
    "module_data": ("EVEN = [i % 2 == 0 for i in range(10**6)]\nMOD, NONE = 7, None\n"  # big: a handle
                    "SMALL = [1, {2}]\ndef f(i):\n    return EVEN[i]",
                    "assert f(4) and not f(3) and EVEN[2] and len(EVEN) == 10**6\n"
                    "assert MOD == 7 and NONE is None and SMALL == [1, {2}]"),
}


@pytest.mark.parametrize("case", HONEST)
def test_tests_use_the_programs_objects_from_the_judge(case):
    reward, info = code_reward(*HONEST[case])
    assert reward == 1.0, info


@pytest.mark.parametrize("code, tests", [
    ("class A:\n    def __eq__(self, o):\n        return True\ndef f():\n    return A()",
     "assert f() == 5"),                                       # equal to anything
    ("class L(list):\n    def __eq__(self, o):\n        return True\ndef f():\n    return L()",
     "assert f() == [1]"),
    ("def abs(x):\n    return 0\ndef f():\n    return 1", "assert abs(f() - 2) < 1e-9"),
    ("import os\ndef f():\n    os._exit(0)",                   # dies where a test catches all
     "try:\n    f()\nexcept Exception:\n    pass\nelse:\n    raise AssertionError"),
    ("import os, sys\ndef f():\n    os.write(int(sys.argv[2]), b\"('ok', ('v', 1))\\n\" * 9)"
     "\n    return 0", "assert f() == 0\nassert f() == 1"),  # answers ahead of the question
    ("print(open('tests.py').read())", "assert True"),         # the tests are not in its reach
])
def test_the_program_cannot_bend_the_judge(code, tests):
    """Only data comes back: its equality, its builtins, its replies do not decide a test."""
    reward, info = code_reward(code, tests)
    assert reward == 0.0 and info["tests_passed"] == 0, info
