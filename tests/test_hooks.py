"""Each registration hook, implemented by a third-party plugin module: its entries are merged into
the registry, looked up by name, selected by `--plugin` and used by the component that owns them
(the estimator/loss hooks have their own tests in tests/test_plugins.py and the plugins')."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.plugins import build_plugins

PLUGIN = """
from dataclasses import dataclass
from molt_core import hookimpl

def contains(response, answer, *, case_sensitive=False):
    a, b = (response, answer) if case_sensitive else (response.lower(), answer.lower())
    return float(b in a), {"reason": "found" if b in a else "missing"}

class Echo:
    def __init__(self, word="hi"):
        self.word = word
    async def reset(self, seed):
        return f"say {self.word} {seed}"
    async def step(self, action):
        return None, contains(action, self.word)[0], True, {}

class Scheme:
    def __init__(self, cfg, generator, policy, engines):
        self.cfg = cfg

class Greeter:
    def __init__(self, greeting="hello"):
        self.greeting = greeting

@dataclass
class MineConfig:
    alpha: float = 1.0
    mode: str = "fast"

@hookimpl
def molt_rewards():
    return {"contains": contains}

@hookimpl
def molt_envs():
    return {"echo": Echo}

@hookimpl
def molt_agents():
    from molt_gym import GymAgent
    return {"gym_mine": GymAgent}

@hookimpl
def molt_engines():
    from molt_core.engines.hf import HFEngine
    return {"hf_mine": HFEngine}

@hookimpl
def molt_trainer_backends():
    from molt_core.policy.handle import Policy
    return {"fsdp2_mine": Policy}

@hookimpl
def molt_rollout_schemes():
    return {"scheme_mine": Scheme}

@hookimpl
def molt_config_sections():
    return {"mine": MineConfig}

@hookimpl
def molt_chat_agents():
    return {"greeter": Greeter}
"""


@pytest.fixture
def mine(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "molt_test_hooks.py").write_text(textwrap.dedent(PLUGIN))
    yield "molt_test_hooks"
    sys.modules.pop("molt_test_hooks", None)


def test_molt_rewards_registers_callable_rewards(mine):
    plugins = build_plugins([mine])
    assert plugins.get("reward", "contains")("Say HI", "hi") == (1.0, {"reason": "found"})
    assert {"math", "exact", "code"} <= plugins.registry["reward"].keys()   # shipped ones


def test_molt_envs_and_molt_agents_build_a_gym_agent_on_a_plugin_env(mine, tiny_recipe):
    cfg, plugins = load(tiny_recipe, ["agent.args.env=echo"], [mine])
    assert cfg.agent.name == "gym_mine"                 # --plugin selects its sole agent
    agent = plugins.get("agent", cfg.agent.name)(cfg, None, plugins, **cfg.agent.args)
    env = agent.env_cls(word="ok")
    assert asyncio.run(env.reset(3)) == "say ok 3"
    assert asyncio.run(env.step("ok!"))[1] == 1.0
    assert {"next_letter", "guess_number"} <= plugins.registry["env"].keys()


def test_molt_engines_backends_and_schemes_are_selected_by_plugin(mine, tiny_recipe):
    cfg, plugins = load(tiny_recipe, [], [mine])
    assert (cfg.engine.name, cfg.trainer.backend, cfg.rollout.scheme) == \
        ("hf_mine", "fsdp2_mine", "scheme_mine")
    scheme = plugins.get("rollout_scheme", "scheme_mine")(cfg, None, None, [])
    assert scheme.cfg is cfg
    assert plugins.get("engine", "hf_mine") is plugins.get("engine", "hf")
    assert plugins.get("trainer_backend", "fsdp2_mine") is plugins.get("trainer_backend", "fsdp2")
    cfg, _ = load(tiny_recipe, [])                       # installed but not selected
    assert (cfg.engine.name, cfg.trainer.backend, cfg.rollout.scheme) == ("hf", "fsdp2", "sync")


def test_molt_config_sections_parse_typed_plugin_options(mine, tiny_recipe):
    cfg, _ = load(tiny_recipe, ["mine.alpha=2", "mine.mode=slow"], [mine])
    assert (cfg.plugins["mine"].alpha, cfg.plugins["mine"].mode) == (2.0, "slow")
    assert load(tiny_recipe, [], [mine])[0].plugins["mine"].alpha == 1.0
    with pytest.raises(ConfigError, match="unknown config key 'mine.beta'.*alpha, mode"):
        load(tiny_recipe, ["mine.beta=1"], [mine])


def test_molt_chat_agents_register_agents_for_the_chat_runner(mine):
    plugins = build_plugins([mine])
    assert plugins.get("chat_agent", "greeter")(greeting="hey").greeting == "hey"
    assert "calculator" in plugins.registry["chat_agent"]        # shipped with molt-agent-chat
