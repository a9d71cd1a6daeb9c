"""Plugin discovery through the real entry-point machinery (installed dist-info)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from molt_core.cli import load
from molt_tools.commands import main
from molt_core.plugins import PluginError, build_plugins

RECIPE = "recipes/cpu/next_letter.yaml"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path where tests install modules and distributions (dist-info)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(dist: str, modules: dict[str, str], entry_points: dict[str, str] = {}) -> None:
        for name, code in modules.items():
            (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
        info = tmp_path / f"{dist.replace('-', '_')}-0.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
        eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (info / "entry_points.txt").write_text(f"[molt]\n{eps}")
    yield install
    for name in [m for m in sys.modules if m.startswith("molt_test_")]:
        del sys.modules[name]


EST = """
from molt_core import hookimpl
def my_adv(rewards, group_index, *, scale=1.0):
    return rewards * scale
@hookimpl
def molt_estimators():
    return {"{name}": my_adv}
"""


def test_installed_grpo_is_discovered_with_its_distribution():
    plugins = build_plugins()
    assert plugins.info["grpo"]["distribution"] == "molt-estimator-grpo"
    assert plugins.registry["estimator"]["grpo"].__module__ == "molt_grpo"
    assert plugins.hooks_of("grpo") == ["molt_estimators", "molt_losses"]


def test_plugin_selects_and_block(site, tiny_recipe):
    site("molt-estimator-mine", {"molt_test_mine": EST.replace("{name}", "mine")},
         {"mine": "molt_test_mine"})
    cfg, plugins = load(tiny_recipe, [], ["mine"])
    assert cfg.algorithm.estimator == "mine"                 # --plugin selects its estimator
    assert plugins.info["mine"] == {"distribution": "molt-estimator-mine", "version": "0.3"}
    cfg, _ = load(tiny_recipe, [])
    assert cfg.algorithm.estimator == "grpo"                 # installed, not selected
    with pytest.raises(PluginError, match="unknown estimator 'grpo'.*blocked plugins: grpo"):
        load(tiny_recipe, [], [], ["no:grpo"])
    plugins = build_plugins([], ["no:grpo"])
    assert "grpo" not in plugins.info and "ppo_clip" not in plugins.registry["loss"]


def test_unknown_plugin_lists_valid_names(capsys, tiny_recipe):
    assert main(["validate", tiny_recipe, "--plugin", "grpoo"]) == 2
    err = capsys.readouterr().err
    assert "unknown plugin 'grpoo'; installed plugins:" in err and "grpo" in err and "gym" in err


def test_misspelled_hook_fails_at_start(site):
    site("molt-bad", {"molt_test_bad": """
        from molt_core import hookimpl
        @hookimpl
        def molt_estimaters():
            return {}
    """}, {"bad": "molt_test_bad"})
    with pytest.raises(PluginError, match="molt_estimaters.*valid molt hooks: .*molt_estimators"):
        build_plugins()


def test_duplicate_entry_point_names_both_distributions(site):
    site("molt-dup-a", {"molt_test_a": EST.replace("{name}", "a")}, {"dup": "molt_test_a"})
    site("molt-dup-b", {"molt_test_b": EST.replace("{name}", "b")}, {"dup": "molt_test_b"})
    with pytest.raises(PluginError, match="'dup': molt-dup-. and molt-dup-."):
        build_plugins()


def test_duplicate_registered_name_names_both_plugins(site):
    site("molt-clash", {"molt_test_clash": EST.replace("{name}", "grpo")}, {"clash": "molt_test_clash"})
    with pytest.raises(PluginError, match="estimator 'grpo' is registered by both plugin"):
        build_plugins()
    assert "grpo" in build_plugins([], ["no:clash"]).registry["estimator"]


def test_module_path_plugin(site, tiny_recipe):
    site("molt-unlisted", {"molt_test_local": EST.replace("{name}", "local")})
    cfg, plugins = load(tiny_recipe, ["algorithm.estimator_args.scale=2.0"], ["molt_test_local"])
    assert cfg.algorithm.estimator == "local"
    assert plugins.info["molt_test_local"]["distribution"] == "(module)"


def test_plugins_command_lists_hooks(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "molt-estimator-grpo" in out and "molt_estimators" in out


def test_plugin_from_the_current_directory_and_from_a_file(tiny_recipe, tmp_path, monkeypatch,
                                                           capsys):
    """`--plugin my_module` finds ./my_module.py and `--plugin ./path/file.py` loads that file
    (on main: 'unknown plugin' and a TypeError); the file's functions pickle by value, so Ray
    actors that cannot import it run them."""
    from ray import cloudpickle

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "molt_test_cwd.py").write_text(EST.replace("{name}", "cwd"))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "molt_test_file.py").write_text(EST.replace("{name}", "from_file"))
    assert main(["validate", tiny_recipe, "--plugin", "molt_test_cwd"]) == 0
    assert "estimator=cwd" in capsys.readouterr().out
    cfg, plugins = load(tiny_recipe, [], ["./sub/molt_test_file.py"])
    assert cfg.algorithm.estimator == "from_file" and plugins.selected == ["molt_test_file"]
    blob = cloudpickle.dumps(plugins.get("estimator", "from_file"))
    del sys.modules["molt_test_file"]
    assert cloudpickle.loads(blob)(2.0, None, scale=3.0) == 6.0
    for bad, says in (("./sub/missing.py", "no file ./sub/missing.py"),
                      ("./sub/json.py", "another module 'json' is imported")):
        (tmp_path / "sub" / "json.py").write_text("")
        with pytest.raises(PluginError, match=says):
            build_plugins([bad])
    del sys.modules["molt_test_cwd"]
