"""Env `openenv` (issue 27): the echo environment openenv-core's own `openenv init` writes, used
as written, served by openenv-core's server app on 127.0.0.1 and trained on token-exactly (two
turns: the sampled ids trainable, the server's echo a masked user turn); a dead server, a wrong
field and a server that drops mid-run are each one clear error."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from openenv.cli.commands.init import init
from transformers import AutoTokenizer

from molt_core import hookimpl
from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.trainer import train
from molt_openenv import OpenEnv
from common import toy_recipe

GROUPS, GROUP_SIZE = 2, 4     # the server holds one step's sessions: a leaked one fails the next


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("openenv")
    init("echo_env", output_dir=str(root))          # what `openenv init echo_env` writes
    sys.path.insert(0, str(root))
    from echo_env.models import EchoAction, EchoObservation
    from echo_env.server.echo_env_environment import EchoEnvironment
    from openenv.core.env_server.http_server import create_app

    # echo_env/server/app.py's create_app call, with room for one step's concurrent rollouts
    app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env",
                     max_concurrent_envs=GROUPS * GROUP_SIZE)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
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
    return toy_recipe(tmp_path, model, rollout={"groups_per_step": GROUPS,
                                                "group_size": GROUP_SIZE},
                      sampling={"max_new_tokens": 4}, out_dir=str(tmp_path / "runs"),
                      agent={"name": "gym", "args": {"env": "openenv", "env_args": env_args,
                                                     "max_turns": 2}})


def test_trains_on_an_openenv_server_token_exactly(ray_local, tiny_chars_dir, tmp_path,
                                                   echo_url):
    path = recipe(tmp_path, tiny_chars_dir, {"url": echo_url, "observation": "echoed_message"})
    cfg, plugins = load(path, ["trainer.steps=2", "check.consistency_every=1"])
    plugins.pm.register(rec := Recorder(), name="recorder")
    (tmp_path / "run").mkdir()
    rows = train(cfg, plugins, tmp_path / "run", progress=False)
    assert not {k: v for r in rows for k, v in r.items() if "dropped" in k and v}
    assert len(rec.trajs) == 2 * GROUPS * GROUP_SIZE
    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    for t in rec.trajs:
        spans = t.turns()           # runs of engine-sampled tokens (those with a weight version)
        assert len(spans) == len(t.turn_rewards) == 2          # echo never ends: max_turns does
        sampled = [i for a, b in spans for i in range(a, b)]
        assert [i for i, m in enumerate(t.loss_mask) if m] == sampled
        actions = [tok.decode(t.token_ids[a:b], skip_special_tokens=True) for a, b in spans]
        assert "environment ready!" in tok.decode(t.token_ids[:spans[0][0]])   # its reset
        # the server got the sampled text: its echo comes back as the masked user turn, and its
        # reward is 0.1 per character
        assert actions[0] in tok.decode(t.token_ids[spans[0][1]:spans[1][0]])
        assert t.turn_rewards == pytest.approx([0.1 * len(a) for a in actions])
        assert t.info == {"message_length": len(actions[1])}


def test_unreachable_server_or_wrong_fields_are_one_clear_error(tiny_chars_dir, tmp_path,
                                                                echo_url):
    dead = f"http://127.0.0.1:{free_port()}"
    for env_args, says in (
            ({"url": dead}, f"env_args.url: no OpenEnv server answers at {dead} "
                            r"\(ConnectionError: .*\); start it or fix the url"),
            ({"url": echo_url + "/nothing"}, "no OpenEnv server answers at"),
            ({"url": echo_url}, r"env_args.observation: the server's observations have fields "
                                "done, reward, metadata, echoed_message, message_length, not "
                                "'message'"),
            ({"url": echo_url, "action": "text", "observation": "echoed_message"},
             "env_args.action: .* have fields metadata, message, not 'text'")):
        with pytest.raises(ConfigError, match=says):
            load(recipe(tmp_path, tiny_chars_dir, env_args), [])
    # the server gone mid-run: the rollout fails with one line naming it (counted and dropped)
    with pytest.raises(RuntimeError, match=f"^OpenEnv server {dead}: ConnectionError: Failed to "
                                           "connect to ws://127.0.0.1:"):
        asyncio.run(OpenEnv(url=dead, timeout_s=5).reset(0))
