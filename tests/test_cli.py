"""The command line: options and overrides in any order, per-command usage, versions."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from molt_core import HOOK_API_VERSION, __version__
from molt_core.cli import COMMANDS, main, parse

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
        parse(["run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: molt run") and "recipe" in err
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
    out = subprocess.run([sys.executable, "-m", "molt_core", "--version"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.splitlines()[0] == f"molt-core {__version__} (hook API {HOOK_API_VERSION})"
    assert "  grpo: molt-estimator-grpo " in out and "  gym: molt-agent-gym " in out
