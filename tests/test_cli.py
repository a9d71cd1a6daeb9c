"""The command line: options and overrides in any order, per-command usage, versions."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from molt_core import HOOK_API_VERSION, __version__
from molt_tools.commands import main
from molt_tools.commands import COMMANDS, parse

ROOT = Path(__file__).parents[1]


def _readme_run_line() -> list[str]:
    line = next(l for l in (ROOT / "README.md").read_text().splitlines()
                if l.startswith("molt run "))
    return shlex.split(line)[1:]


def test_readme_example_parses_as_written(capsys, tiny_recipe):
    argv = _readme_run_line()
    assert argv == ["run", "recipes/cpu/next_letter.yaml", "--plugin", "grpo", "trainer.steps=50",
                    "seed=1"]
    args = parse(argv)
    assert (args.recipe, args.plugin, args.overrides) == (argv[1], ["grpo"],
                                                          ["trainer.steps=50", "seed=1"])
    # the same tail against the tiny model: the overrides after --plugin reach the config
    assert main(["validate", tiny_recipe, *argv[2:]]) == 0
    from molt_core.cli import load
    cfg, _ = load(tiny_recipe, args.overrides, args.plugin)
    assert (cfg.trainer.steps, cfg.seed, cfg.algorithm.estimator) == (50, 1, "grpo")


@pytest.mark.parametrize("argv", [
    ["validate", "R", "seed=2", "--plugin", "grpo", "trainer.steps=3", "-p", "no:dapo"],
    ["validate", "--plugin", "grpo", "-p", "no:dapo", "R", "seed=2", "trainer.steps=3"],
    ["validate", "R", "-p", "no:dapo", "seed=2", "trainer.steps=3", "--plugin", "grpo"],
])
def test_options_and_overrides_in_any_order(argv):
    args = parse(argv)
    assert args.recipe == "R" and args.plugin == ["grpo"] and args.blocked == ["no:dapo"]
    assert sorted(args.overrides) == ["seed=2", "trainer.steps=3"]


def test_usage_errors_print_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["run", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: molt run") and "recipe" in err
    assert main(["run"]) == 2        # the recipe is optional only with --resume
    assert "molt run needs a recipe (or --resume RUN_DIR)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["tiny-model", "d", "--arch", "llama"])
    assert capsys.readouterr().err.startswith("usage: molt tiny-model")
    with pytest.raises(SystemExit):
        parse(["rnu", "x"])
    assert "unknown command 'rnu'; did you mean 'run'?" in capsys.readouterr().err


def test_every_command_builds_its_parser_and_help(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            parse([name, "-h"])
        assert e.value.code == 0 and capsys.readouterr().out.startswith(f"usage: molt {name}")


def test_version_lists_core_hook_api_and_plugins():
    out = subprocess.run([sys.executable, "-m", "molt_tools", "--version"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.splitlines()[0] == f"molt-core {__version__} (hook API {HOOK_API_VERSION})"
    assert "  grpo: molt-estimator-grpo " in out and "  gym: molt-agent-gym " in out


def _one_line_error(capsys, argv: list[str], out_dir: Path) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert not out_dir.exists()                     # failed before the run dir is made
    return err


@pytest.fixture
def bad_inputs(tmp_path, tiny_model_dir, monkeypatch):
    """Files for each input that used to end in a traceback."""
    (tmp_path / "malformed.yaml").write_text("trainer: {steps: 3\n")
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "molt_test_boom.py").write_text("raise RuntimeError('boom at import')\n")
    for name, config in [("bad_config", "{not json"), ("no_weights", '{"model_type": "qwen3"}')]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
    for f in tiny_model_dir.glob("*.safetensors"):
        (tmp_path / "bad_config" / f.name).symlink_to(f)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "answer": "b"}\n' * 3)
    (tmp_path / "molt_test_rewards.py").write_text("def exact(completion, answer):\n"
                                                   "    return float(completion == answer)\n")
    yield tmp_path
    for name in ("molt_test_boom", "molt_test_rewards"):
        sys.modules.pop(name, None)


DATASET = ["agent.args={env: dataset, env_args: {data: DIR/rows.jsonl, test_fraction: 0.0, "
           "reward: 'molt_test_rewards:exact'}}"]


@pytest.mark.parametrize("extra, expect", [
    (["RECIPE=malformed.yaml"], "is not valid YAML: expected ',' or '}'"),
    (["RECIPE=binary.yaml"], "is not a text file"),
    (["trainer.betas=[1"], "override 'trainer.betas=[1': the value is not valid YAML"),
    (["--plugin", "molt_test_boom"], "plugin module 'molt_test_boom' failed to import: "
                                     "RuntimeError: boom at import"),
    (["model.path=DIR/bad_config"], "config.json is not a valid model config"),
    (["model.path=DIR/no_weights"], "has no weights"),
    (["trainer.lr=.inf"], "'trainer.lr' must be a finite float, got inf"),
    (["sampling.temperature=.inf"], "'sampling.temperature' must be a finite float"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip must be > 0"),
    (["agent.timeout_s=-5"], "agent.timeout_s must be > 0 seconds"),
    (["trainer.weight_sync_timeout_s=0"], "trainer.weight_sync_timeout_s must be > 0"),
    (["name=../../x"], "name '../../x' must be a plain run name"),
    (["agent.args.env=nope"], "unknown env 'nope'; valid: "),
    (["agent.args.env={a: 1}"], "agent.args.env: agent 'gym' (plugin gym) expects str, got"),
    (["agent.args.env_args.letters=5"], "agent.args.env_args.letters: env 'next_letter' (plugin "
                                        "examples) expects str, got 5 (int)"),
    (["algorithm.estimator_args.eps=abc"], "algorithm.estimator_args.eps: estimator 'grpo' "
                                           "(plugin grpo) expects a finite float, got 'abc'"),
    (["algorithm.loss_args.clip_low=[1]"], "loss 'ppo_clip' (plugin grpo) expects a finite float"),
    (["algorithm.estimator_args.std_floor=1"], "estimator 'grpo' (plugin grpo) does not accept "
                                               "std_floor; it accepts: eps, norm_std"),
    # found by `molt run` once the config and plugins loaded, before it starts a process
    ([*DATASET, "eval.every=2"], "agent 'gym' env 'dataset' serves no held-out split"),
    ([*DATASET, "eval.every=2", "eval.agent_args={env_args: {test_fraction: 0.5}}"],
     "eval.agent_args={env_args: {split: test}} (gym envs with a split: dataset"),
    (["ray.embedded=on", "trainer.cpus_per_rank=64"], "one trainer rank needs {'CPU': 64.0}"),
])
def test_bad_input_is_one_line_exit_2_and_validate_says_the_same(capsys, bad_inputs, tiny_recipe,
                                                                 extra, expect):
    """Every refusal of `molt run`, from the recipe to what it checks before starting a process
    (`trainer.prepare`), is `molt validate`'s too, word for word."""
    out_dir = bad_inputs / "runs"
    recipe = [str(bad_inputs / e.split("=", 1)[1]) for e in extra if e.startswith("RECIPE=")]
    extra = [e.replace("DIR", str(bad_inputs)) for e in extra if not e.startswith("RECIPE=")]
    args = [*(recipe or [tiny_recipe]), f"out_dir={out_dir}", *extra]
    err = _one_line_error(capsys, ["run", *args, "--no-progress"], out_dir)
    assert expect in err
    assert _one_line_error(capsys, ["validate", *args], out_dir) == err



def test_chat_agent_args_are_checked_at_validate(capsys, tiny_model_dir, tmp_path):
    out_dir = tmp_path / "runs"
    argv = ["run", str(ROOT / "recipes/cpu/chat_calculator.yaml"), f"model.path={tiny_model_dir}",
            f"out_dir={out_dir}", "agent.args.agent_args.lo=abc", "--no-progress"]
    assert ("agent.args.agent_args.lo: chat_agent 'calculator' (plugin examples) expects int, got "
            "'abc'") in _one_line_error(capsys, argv, out_dir)

def test_misspelled_hook_names_only_real_hooks_and_the_closest(tmp_path, monkeypatch):
    from molt_core.plugins import PluginError, build_plugins
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "molt_test_typo.py").write_text(
        "from molt_core import hookimpl\n@hookimpl\ndef molt_estimator():\n    return {}\n")
    with pytest.raises(PluginError) as e:
        build_plugins(["molt_test_typo"])
    msg = str(e.value)
    assert ("plugin 'molt_test_typo' implements unknown hook 'molt_estimator'; did you mean "
            "'molt_estimators'?") in msg
    assert "molt_estimator," not in msg.split("valid molt hooks:")[1] + ","
    assert "molt_losses" in msg
    sys.modules.pop("molt_test_typo", None)


@pytest.mark.parametrize("declared, ok", [(f">={HOOK_API_VERSION},<{HOOK_API_VERSION + 1}", True),
                                          (f">={HOOK_API_VERSION + 1}", False), ("one", False)])
def test_hook_api_range(tmp_path, monkeypatch, declared, ok):
    from molt_core.plugins import PluginError, build_plugins
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"molt_test_api{abs(hash(declared))}"
    (tmp_path / f"{name}.py").write_text(f"MOLT_HOOK_API = {declared!r}\n")
    if ok:
        assert name in build_plugins([name]).info
        return
    with pytest.raises(PluginError, match=f"plugin '{name}'") as e:
        build_plugins([name])
    assert declared in str(e.value)
    if declared != "one":
        assert f"molt-core {__version__} has hook API {HOOK_API_VERSION}" in str(e.value)


def test_trace_shows_registration_pipeline_and_registry_calls(monkeypatch, capsys):
    import torch

    from molt_core.plugins import build_plugins
    monkeypatch.setenv("MOLT_TRACE_PLUGINS", "1")
    plugins = build_plugins()
    err = capsys.readouterr().err
    assert "molt trace: hook molt_estimators (plugin grpo)()" in err      # registration
    adv = plugins.get("estimator", "grpo")(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    assert adv[0] > 0 > adv[1]
    plugins.hook.molt_on_step_end(step=3, metrics={})
    filters = plugins.hook.molt_filter_batch.get_hookimpls()
    filters[0].function(groups=[], step=3, refill=lambda n: [])   # as the trainer calls it
    err = capsys.readouterr().err
    assert "molt trace: estimator 'grpo' (plugin grpo)([2], [2])" in err
    assert "molt trace: hook molt_on_step_end (plugin" in err and "step=3" in err
    assert "molt trace: hook molt_filter_batch (plugin dapo)(groups=[], step=3" in err


@pytest.mark.parametrize("steps, inert", [("trainer.mini_batches=1", True),
                                          ("trainer.mini_batches=2", False)])
def test_clip_args_that_cannot_act_are_named(capsys, tiny_recipe, steps, inert):
    """Under a correction the loss clips pi_theta/pi_prox, which is 1 with one step per batch."""
    assert main(["validate", tiny_recipe, "algorithm.correction=tis",
                 "algorithm.loss_args={clip_low: 0.1}", steps]) == 0
    err = capsys.readouterr().err
    assert ("['clip_low'] do not act" in err) == inert, err


def test_run_in_a_fresh_process_prestarts_ray_and_stops_it_on_bad_input(tiny_recipe, tmp_path):
    """`molt run` in a fresh process starts Ray while it imports (cluster.prestart): a run trains
    and stops its Ray; an error the plugins find after that start is still one line, and leaves
    no Ray process behind either."""
    import os
    import tempfile

    import psutil
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")    # short: Ray's socket paths
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    run = [sys.executable, "-m", "molt_tools", "run", tiny_recipe, f"out_dir={tmp_path}/runs",
           "trainer.steps=2", "--no-progress"]
    ok = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env)
    assert ok.returncode == 0 and "(2 steps)" in ok.stdout, ok.stderr
    for extra, says in (("agent.args.env=nope", "unknown env 'nope'"),        # the plugins
                        ("eval.every=1", "eval: agent 'gym' env 'next_letter'")):   # prepare
        bad = subprocess.run([*run, extra], capture_output=True, text=True, timeout=300, env=env)
        assert bad.returncode == 2 and bad.stderr.startswith(f"error: {says}"), bad.stderr
        assert bad.stderr.count("\n") == 1
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if ray_tmp in " ".join(p.info["cmdline"] or [])]
    assert not left, f"Ray processes left behind: {left}"


def _imported(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """Which of `names` a fresh `molt ARGV` process imported."""
    code = ("import contextlib, sys; from molt_tools.commands import main\n"
            "with contextlib.suppress(SystemExit): main(sys.argv[1:])\n"
            f"print(*sorted(m for m in {names!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()[-1].split()


def test_look_around_commands_import_no_plugin_torch_or_transformers():
    """`--version` and `-h` read entry-point metadata only (they took ~12 s importing plugins)."""
    for argv in (["--version"], ["-h"]):
        assert _imported(argv, ("torch", "transformers", "ray", "molt_grpo")) == [], argv


def test_listing_plugins_imports_no_torch_transformers_or_ray():
    """`molt plugins` imports every installed plugin but none of these (it took ~12 s): a plugin
    module reads torch through `molt_core.lazy`, engines and trainer backends register as
    "module:Class" (imported by `Plugins.get`), transformers is imported where it is used."""
    assert _imported(["plugins"], ("torch", "transformers", "ray", "fastapi")) == []


def test_no_third_party_progress_bars(tmp_path):
    """transformers' tqdm bars ("Writing model shards") stay off the console, also where the
    command's parser imports transformers (tiny-model) before the CLI turns them off."""
    done = subprocess.run([sys.executable, "-m", "molt_tools", "tiny-model", str(tmp_path / "m"),
                           "--chars"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "it/s" not in done.stderr and "Writing model shards" not in done.stderr, done.stderr


@pytest.mark.parametrize("override, hint", [
    ("algorithm.estimator=gpro", "error: unknown estimator 'gpro'; did you mean 'grpo'? valid: "),
    ("trainer.step=3", "error: unknown config key 'trainer.step'; did you mean 'steps'? valid "
                       "keys here: "),
])
def test_typos_get_the_closest_valid_name_before_the_valid_ones(capsys, tiny_recipe, override,
                                                                 hint):
    assert main(["validate", tiny_recipe, override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(hint) and err.count("\n") == 1       # the hint, then the list
    assert "pip install" not in err


def test_plugins_listing_is_sorted(capsys):
    assert main(["plugins"]) == 0
    names = [l.split()[0] for l in capsys.readouterr().out.splitlines() if not l.startswith(" ")]
    assert names == sorted(names) and "grpo" in names


def test_config_prints_with_a_warning_when_weights_are_missing(capsys, tiny_recipe, tmp_path):
    import yaml
    empty = tmp_path / "no-weights"
    empty.mkdir()
    model = Path(yaml.safe_load(Path(tiny_recipe).read_text())["model"]["path"])
    (empty / "config.json").write_text((model / "config.json").read_text())
    assert main(["config", tiny_recipe, f"model.path={empty}"]) == 0
    captured = capsys.readouterr()
    assert "trainer:" in captured.out and f"path: {empty}" in captured.out
    assert "has no weights" in captured.err
    assert main(["validate", tiny_recipe, f"model.path={empty}"]) == 2     # still an error there


def test_help_examples_fit_the_command(capsys):
    for name in ("eval", "serve", "run", "config"):
        with pytest.raises(SystemExit):
            parse([name, "-h"])
        out = capsys.readouterr().out
        assert f"examples:\n  molt {name} " in out
        assert ("trainer.steps=50" in out) == (name == "run"), name
    with pytest.raises(SystemExit):
        parse(["run", "-h"])
    assert "no progress bar: one log line per step" in capsys.readouterr().out


def test_log_level_from_env_and_flags(monkeypatch):
    assert parse(["plugins"]).log_level == "INFO"
    assert parse(["plugins", "-q"]).log_level == "WARNING"
    assert parse(["plugins", "-qq"]).log_level == "ERROR"
    assert parse(["plugins", "-v"]).log_level == "DEBUG"
    monkeypatch.setenv("MOLT_LOG_LEVEL", "warning")
    assert parse(["plugins"]).log_level == "WARNING"
    assert parse(["plugins", "-v"]).log_level == "INFO"


def test_where_chat_calculator_is_served_its_model_build_is_shown(capsys):
    """recipes/cpu/chat_calculator.yaml's model is built by a tool first (only the recipe's
    comment said so): every code block and help text that serves or rolls it out shows how."""
    build = "python -m molt_tools.calculator_model .cache/tiny-qwen3-calculator"
    shown = 0
    for page in ("README.md", "docs/agents.md"):
        for block in (ROOT / page).read_text().split("```")[1::2]:
            if re.search(r"molt (serve|rollout) recipes/cpu/chat_calculator", block):
                assert build in block, f"{page}:\n{block}"
                shown += 1
    assert shown >= 2
    for name in ("serve", "rollout"):
        with pytest.raises(SystemExit):
            parse([name, "-h"])
        assert build in capsys.readouterr().out, name
