"""Broken third-party plugins, through the real plugin manager: each mistake is one PluginError
naming the plugin, the hook or entry, what it returned and what was expected (issue 25 item 11);
absurd rewards are dropped and counted like NaN ones."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from molt_core.cli import load
from molt_core.plugins import PluginError, build_plugins
from molt_tools.commands import main
from molt_tools.testing import fake_groups, run_step

from common import toy_recipe

BAD = '''
import torch
from molt_core import hookimpl
from molt_grpo import ppo_clip_loss


def short(rewards, group_index):
    return rewards[:-1]


def nan_adv(rewards, group_index):
    return rewards / 0.0 * 0.0


def raises(rewards, group_index):
    return {}["no_such_key"]


def bare_loss(logprobs, behavior_logprobs, advantages, mask):
    return ppo_clip_loss(logprobs, behavior_logprobs, advantages, mask)[0]


@hookimpl
def molt_estimators():
    return {"short": short, "nan_adv": nan_adv, "raises": raises}


@hookimpl
def molt_losses():
    return {"bare_loss": bare_loss}
'''
STEP = '''
from molt_core import hookimpl

@hookimpl
def molt_on_step_end(step, metrics):
    metrics["reward/mean"] += 1
'''
REG_RAISES = '''
from molt_core import hookimpl

@hookimpl
def molt_estimators():
    from molt_no_such_module import grpo
    return {"mine": grpo}
'''
REG_LIST = '''
from molt_core import hookimpl

def mine(logprobs, behavior_logprobs, advantages, mask):
    return logprobs, {}

@hookimpl
def molt_losses():
    return [mine]
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """plugin(name, code): the module importable here and, pickled by value, on Ray workers."""
    import ray.cloudpickle

    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(name: str, code: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
        module = __import__(name)
        ray.cloudpickle.register_pickle_by_value(module)
        made.append(module)
        return name
    yield make
    for module in made:
        ray.cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[module.__name__]


def _loss():
    from molt_grpo import ppo_clip_loss
    return ppo_clip_loss


@pytest.mark.parametrize("name, message", [
    ("short", r"estimator 'short' \(plugin molt_test_bad\) must return advantages \[R\] \(one "
              r"per rollout\) of shape \(4,\); got \[\(3,\)\]"),
    ("nan_adv", r"estimator 'nan_adv' \(plugin molt_test_bad\) returned non-finite values \(4 "
                r"of advantages \[R\] .*\); expected finite ones"),
    ("raises", r"estimator 'raises' \(plugin molt_test_bad\) raised KeyError: 'no_such_key'")])
def test_bad_estimator_output_names_the_plugin(plugin, name, message):
    plugins = build_plugins([plugin("molt_test_bad", BAD)])
    with pytest.raises(PluginError, match=message):
        run_step(plugins.get("estimator", name), _loss(), fake_groups([[1.0, 0.0], [0.0, 1.0]]))


def test_loss_returning_a_bare_tensor_stops_the_run_naming_the_plugin(
        ray_local, tiny_chars_dir, tmp_path, plugin, capsys):
    """It used to train silently; the loss runs on the Ray trainer ranks."""
    name = plugin("molt_test_bad", BAD)
    recipe = toy_recipe(tmp_path, tiny_chars_dir, out_dir=str(tmp_path / "runs"))
    assert main(["run", recipe, "trainer.steps=2", "algorithm.loss=bare_loss", "--no-progress",
                 "--plugin", name]) == 2
    err = capsys.readouterr().err
    assert "error: loss 'bare_loss' (plugin molt_test_bad) returned Tensor [" in err, err
    assert "expected (per_token_loss [b, T], metrics dict)" in err
    assert "Traceback" not in err


def test_step_hook_that_raises_names_the_plugin_and_hook(plugin, tiny_recipe):
    cfg, plugins = load(tiny_recipe, [], [plugin("molt_test_step", STEP)])
    with pytest.raises(PluginError, match=r"hook molt_on_step_end of plugin 'molt_test_step' "
                                          r"raised KeyError: 'reward/mean'"):
        plugins.hook.molt_on_step_end(step=0, metrics={"loss": 1.0})


def test_registration_hook_that_raises_or_returns_a_list_names_the_plugin(plugin):
    with pytest.raises(PluginError, match=r"hook molt_estimators of plugin 'molt_test_reg_raises' "
                                          r"raised ModuleNotFoundError: No module named "
                                          r"'molt_no_such_module'"):
        build_plugins([plugin("molt_test_reg_raises", REG_RAISES)])
    with pytest.raises(PluginError, match=r"hook molt_losses of plugin 'molt_test_reg_list' "
                                          r"returned list \[<function mine.*; expected a dict "
                                          r"\{name: loss\}"):
        build_plugins([plugin("molt_test_reg_list", REG_LIST)])


def test_good_plugins_still_run_through_the_guard():
    plugins = build_plugins()
    grpo = plugins.get("estimator", "grpo")
    assert grpo.__module__ == "molt_grpo" and grpo.molt_origin == "estimator 'grpo' (plugin grpo)"
    out = run_step(grpo, plugins.get("loss", "ppo_clip"), fake_groups([[1.0, 0.0]]))
    assert torch.isfinite(out.loss) and set(out.metrics) >= {"clip_fraction"}


@pytest.mark.parametrize("reward", [1e38, -1e7, float("inf")])
def test_absurd_rewards_are_dropped_and_counted(tiny_chars_dir, tmp_path, reward):
    from molt_core.rollout.generator import Generator
    from molt_core.trajectory import Trajectory

    class Agent:
        async def rollout(self, ctx):
            t = Trajectory()
            t.add_prompt([1, 2])
            t.reward = reward
            return t
    cfg, _ = load(toy_recipe(tmp_path, tiny_chars_dir), [])
    gen = Generator(Agent(), [], cfg, None, 100)
    try:
        assert gen.submit(gen.run_one(0, 0)).result() is None
    finally:
        gen.close()
    kind = "nonfinite_reward" if reward == float("inf") else "absurd_reward"
    assert gen.counters[f"rollout/dropped/{kind}"] == 1 and gen.counters["rollout/failed"] == 1
    assert any(f"returned reward {reward!r}" in e for e in gen._errors), gen._errors
