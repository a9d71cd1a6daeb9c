"""Env `openenv` (issue 27): docs/adapters/openenv.md's example. The echo environment openenv-core's
own `openenv init` writes, served by its own `server/app.py` (capacity raised as the page says) on
127.0.0.1, trained on token-exactly with the page's recipe (two turns: the sampled ids trainable,
the server's echo a masked user turn); a dead server, a wrong field and a server gone mid-run are
each one clear error."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
import yaml
from openenv.cli.commands.init import init
from transformers import AutoTokenizer

from molt_core import hookimpl
from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.trainer import train
from molt_openenv import OpenEnv

pytestmark = pytest.mark.timeout(1800)     # a server that never starts: a hang guard, not speed
DOC = (Path(__file__).parents[1] / "docs" / "adapters" / "openenv.md").read_text()
RECIPE = yaml.safe_load(re.search(r'```yaml title="echo.yaml"\n(.*?)```', DOC, re.S)[1])
# the server holds one step's sessions: a session left open fails the next step
ROLLOUTS = RECIPE["rollout"]["groups_per_step"] * RECIPE["rollout"]["group_size"]


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("openenv")
    init("echo_env", output_dir=str(root))          # what `openenv init echo_env` writes
    app_py = root / "echo_env" / "server" / "app.py"
    edit = re.search(r"sed -i 's/(.*?)/(.*?)/' echo_env/server/app.py", DOC)   # the page's edit
    assert edit[1] in app_py.read_text() and edit[2] == f"max_concurrent_envs={ROLLOUTS},"
    app_py.write_text(app_py.read_text().replace(edit[1], edit[2]))
    sys.path.insert(0, str(root))
    from echo_env.server.app import app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():     # a hang is pytest-timeout's to stop
        time.sleep(0.05)
    assert server.started, "the OpenEnv server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m.split(".")[0] == "echo_env"]:
            del sys.modules[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recorder:
    """Test plugin: the rollouts each step trains on (the last batch filter sees them)."""

    def __init__(self) -> None:
        self.trajs: list = []

    @hookimpl
    def molt_filter_batch(self, groups, step):
        self.trajs += [t for g in groups for t in g]


def recipe(tmp_path: Path, model: Path, env_args: dict) -> str:
    """The page's recipe on `model`, its env_args updated."""
    data = yaml.safe_load(yaml.safe_dump(RECIPE))
    data["model"]["path"], data["out_dir"] = str(model), str(tmp_path / "runs")
    data["agent"]["args"]["env_args"].update(env_args)
    (tmp_path / "echo.yaml").write_text(yaml.safe_dump(data))
    return str(tmp_path / "echo.yaml")


def test_trains_on_an_openenv_server_token_exactly(ray_local, tiny_chars_dir, tmp_path,
                                                   echo_url):
    path = recipe(tmp_path, tiny_chars_dir, {"url": echo_url})
    cfg, plugins = load(path, ["trainer.steps=2", "check.consistency_every=1"])
    plugins.pm.register(rec := Recorder(), name="recorder")
    (tmp_path / "run").mkdir()
    rows = train(cfg, plugins, tmp_path / "run", progress=False)
    assert not {k: v for r in rows for k, v in r.items() if "dropped" in k and v}
    assert len(rec.trajs) == 2 * ROLLOUTS
    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    for t in rec.trajs:
        spans = t.turns()           # runs of engine-sampled tokens (those with a weight version)
        assert len(spans) == len(t.turn_rewards) == 2          # echo never ends: max_turns does
        sampled = [i for a, b in spans for i in range(a, b)]
        assert [i for i, m in enumerate(t.loss_mask) if m] == sampled
        actions = [tok.decode(t.token_ids[a:b], skip_special_tokens=True) for a, b in spans]
        # its reset's "Echo Env environment ready!" (the character-level tokenizer has no capitals)
        assert "environment ready!" in tok.decode(t.token_ids[:spans[0][0]])
        # the server got the sampled text: its echo comes back as the masked user turn, and its
        # reward is 0.1 per character
        assert actions[0] in tok.decode(t.token_ids[spans[0][1]:spans[1][0]])
        assert t.turn_rewards == pytest.approx([0.1 * len(a) for a in actions])
        assert t.info == {"message_length": len(actions[1])}


def test_unreachable_server_or_wrong_fields_are_one_clear_error(tiny_chars_dir, tmp_path,
                                                                echo_url):
    dead = f"http://127.0.0.1:{free_port()}"
    for env_args, says in (
            ({"url": dead, "timeout_s": 5}, f"env_args.url: no OpenEnv server answers at {dead} "
                                            r"\(ConnectionError: .*\); start it or fix the url"),
            ({"url": echo_url + "/nothing"}, "no OpenEnv server answers at"),
            ({"url": echo_url, "observation": "message"},
             "env_args.observation: the server's observations have fields done, reward, "
             "metadata, echoed_message, message_length, not 'message'"),
            ({"url": echo_url, "action": "text"},
             "env_args.action: .* have fields metadata, message, not 'text'")):
        with pytest.raises(ConfigError, match=says):
            load(recipe(tmp_path, tiny_chars_dir, env_args), [])
    # the server gone mid-run: the rollout fails with one line naming it (counted and dropped)
    with pytest.raises(RuntimeError, match=f"^OpenEnv server {dead}: ConnectionError: Failed to "
                                           "connect to ws://127.0.0.1:"):
        asyncio.run(OpenEnv(url=dead, timeout_s=5).reset(0))
