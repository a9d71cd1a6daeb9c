"""`molt serve-tinker` on loopback with a tiny character-level Qwen3, driven by the real `tinker`
SDK (pinned in the test extra, unpatched): one server per test session."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from molt_tools.tiny import CHARSET, build_tiny_model

pytest.importorskip("tinker")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_chars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tinker") / "chars", "qwen3", charset=CHARSET)


def write_recipe(root: Path, model: Path) -> Path:
    """The smallest recipe: the model, the hf engine (agent and env are validated, not used)."""
    (root / "rows.jsonl").write_text('{"prompt": "a", "answer": "b"}\n')
    data = {"name": "tinker_test", "seed": 0, "model": {"path": str(model)},
            "engine": {"name": "hf"}, "out_dir": str(root / "runs"),
            "agent": {"name": "gym", "args": {"env": "dataset", "env_args": {
                "data": str(root / "rows.jsonl"), "reward": "molt_reward_exact:exact_match"}}}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(data))
    return root / "recipe.yaml"


@pytest.fixture(scope="session")
def recipe(tiny_chars: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("tinker-recipe"), tiny_chars)


API_KEY = "tml-local-test"
SESSION_TIMEOUT_S = 15.0            # > the SDK's 10 s heartbeat; the expiry test outwaits it


@contextlib.contextmanager
def serve(recipe: Path, default: bool = True) -> Iterator[str]:
    """Run `molt serve-tinker RECIPE` on a free loopback port; yield its base URL (with
    TINKER_BASE_URL and a key set for the SDK while it runs, if it is the `default` server);
    stop it after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(recipe.parent / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "molt_tools", "serve-tinker", str(recipe),
                             "--port", str(port), "--session-timeout", str(SESSION_TIMEOUT_S)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"molt serve-tinker exited: {(recipe.parent / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        with pytest.MonkeyPatch.context() as mp:
            if default:
                mp.setenv("TINKER_BASE_URL", url)
                mp.setenv("TINKER_API_KEY", API_KEY)
            yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def server(recipe: Path) -> Iterator[str]:
    """The base URL of a running `molt serve-tinker` on the tiny character-level model."""
    with serve(recipe) as url:
        yield url


@pytest.fixture
def session_timeout() -> float:
    return SESSION_TIMEOUT_S


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def bpe_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the BPE server's recipe; its run directories go under runs/."""
    return tmp_path_factory.mktemp("tinker-bpe")


@pytest.fixture(scope="session")
def bpe_server(bpe_root: Path) -> Iterator[str]:
    """A second server on a tiny byte-level-BPE Qwen3 (any text, newlines and capitals included,
    and Qwen3's special tokens): the model the cookbook's `qwen3` renderer tokenises for. It
    is not the session's default server: a test that uses it points TINKER_BASE_URL at it
    itself (`monkeypatch`), so the tests after it still reach `server`."""
    model = build_tiny_model(bpe_root / "bpe", "qwen3")
    with serve(write_recipe(bpe_root, model), default=False) as url:
        yield url
