"""The code reward runs real subprocesses: limits hold and the caller is untouched."""

from __future__ import annotations

import resource
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from molt_reward_code import code_reward, extract_code, network_isolation_available

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


def test_infinite_loop_is_killed_within_the_time_limit():
    t0 = time.perf_counter()
    reward, info = code_reward("while True:\n    pass", "", timeout_s=1.0)
    assert reward == 0.0 and info["reason"] == "timeout"
    assert time.perf_counter() - t0 < 3.0


def test_background_children_die_with_the_program():
    code = ("import subprocess, time\np = subprocess.Popen(['sleep', '30'])\n"
            "print(p.pid, flush=True)\ntime.sleep(30)")
    reward, info = code_reward(code, "", timeout_s=1.0)
    assert info["reason"] == "timeout"
    pid = int(info["stdout"].split()[0])          # the sandbox shares the caller's pid namespace
    time.sleep(0.2)
    assert _state(pid) in (None, "Z")              # gone, or killed and awaiting its reaper


def _state(pid: int) -> str | None:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


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


@pytest.mark.skipif(not network_isolation_available(), reason="unshare -rn not permitted here")
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
