"""Config loading, overrides and the bad-config errors (before any process starts)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import ray
import yaml

from molt_tools.commands import main
from molt_core.config import ConfigError, load_config

RECIPE = "recipes/cpu/next_letter.yaml"


@pytest.fixture
def recipe(tmp_path, tiny_model_dir):
    def write(**changes):
        data = yaml.safe_load(open(RECIPE))
        data["model"]["path"] = str(tiny_model_dir)
        for key, value in changes.items():
            node = data
            *parents, last = key.split("__")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)
    return write


def test_overrides_are_typed(recipe):
    cfg = load_config(recipe(), ["trainer.steps=7", "sampling.temperature=0.5", "seed=3",
                                 "agent.args.env=guess_number"])
    assert (cfg.trainer.steps, cfg.sampling.temperature, cfg.seed) == (7, 0.5, 3)
    assert cfg.agent.args["env"] == "guess_number"


def test_exponent_floats_without_a_dot(recipe, tmp_path):
    """YAML 1.1 reads `3e-4` as a string; in a recipe and on the command line it is a float."""
    assert load_config(recipe(), ["trainer.lr=3e-4"]).trainer.lr == 3e-4
    text = open(recipe()).read().replace("lr: ", "lr: 2E-5 #", 1)
    (tmp_path / "exp.yaml").write_text(text)
    assert load_config(tmp_path / "exp.yaml").trainer.lr == 2e-5
    assert load_config(recipe(), ["name=1e"]).name == "1e"          # not a number: text


@pytest.mark.parametrize("change, override, message", [
    ({}, "trainer.stepz=3", "unknown config key 'trainer.stepz'; did you mean 'steps'? valid "
                            "keys here: backend"),
    ({}, "trainer.steps=abc", "config key 'trainer.steps' must be int, got 'abc'"),
    ({}, "trainer.steps=0", "trainer.steps must be > 0"),
    ({}, "trainer.lora.dropout=0.05", "trainer.lora.dropout=0.05: Molt trains without adapter "
                                      "dropout"),   # accepted and silently off (issue 41.7)
    ({}, "model.path=/nonexistent/model", "model.path '/nonexistent/model' has no config.json"),
    ({"model__path": ""}, None, "model.path is missing"),
    ({}, "algorithm.loss_args.clip_lo=0.1", "does not accept clip_lo; it accepts: clip_high, clip_low"),
    ({}, "algorithm.estimator=nope", "unknown estimator 'nope'; valid: dapo, dr_grpo, gigpo, grpo"),
    ({}, "algorithm.terms.kl_in=rewards", "config key 'algorithm.terms.kl_in' must be one of loss, reward, got 'rewards'"),
    ({}, "algorithm.terms.entropy_coef=-0.1", "algorithm.terms.entropy_coef must be >= 0"),
    ({}, "out_dir=FILE/runs", "is (inside) a file, not a folder: set out_dir to a folder"),
    ({}, "model.path=LIST", "config.json is not a valid model config (not a JSON object"),
])
def test_bad_config_is_one_clear_error_and_starts_nothing(recipe, capsys, monkeypatch, tmp_path,
                                                          change, override, message):
    # Starting Ray at all is the failure (another test file may already hold a session of it).
    def no_ray(*a, **kw):
        raise AssertionError("a bad config must not start Ray")
    monkeypatch.setattr(ray, "init", no_ray)
    (tmp_path / "a_file").write_text("")
    (listed := tmp_path / "listed").mkdir()
    (listed / "config.json").write_text("[1, 2]")    # a traceback before (issue 41.11)
    override = override and override.replace("FILE", str(tmp_path / "a_file")).replace(
        "LIST", str(listed))
    args = ["run", recipe(**change)] + ([override] if override else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("error:") == 1


def test_config_rules_do_not_import_config():
    """config.py imports config_rules (validate), never the other way round (issue 41, mend 5)."""
    code = "import sys, molt_core.config_rules; print('molt_core.config' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_wrong_section_type(recipe):
    with pytest.raises(ConfigError, match="section 'trainer': expected a mapping"):
        load_config(recipe(trainer=5))


def test_validate_ok(recipe, capsys):
    assert main(["validate", recipe()]) == 0
    assert "ok:" in capsys.readouterr().out


def test_paths_missing_from_cwd_are_read_next_to_the_recipe(tiny_model_dir, tmp_path,
                                                             monkeypatch):
    """model.path, chat_template and the data files (agent, eval, sft; a file or {split: file})
    relative to the recipe's folder (issue 41.11: read from the working directory only)."""
    (folder := tmp_path / "recipes").mkdir()
    (folder / "model").symlink_to(tiny_model_dir)
    (folder / "chat.jinja").write_text("{{ messages }}")
    (folder / "rows.jsonl").write_text("")
    data = yaml.safe_load(open(RECIPE))
    data["model"].update(path="model", chat_template="chat.jinja")
    data["agent"]["args"]["env_args"] = {"data": "rows.jsonl"}
    (folder / "r.yaml").write_text(yaml.safe_dump(data))
    (elsewhere := tmp_path / "cwd").mkdir()
    monkeypatch.chdir(elsewhere)
    data["eval"] = {"agent_args": {"env_args": {"data": {"test": "rows.jsonl", "x": "nowhere"}}}}
    data["sft"] = {"data": "rows.jsonl"}
    (folder / "r.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config("../recipes/r.yaml")
    assert (cfg.model.path, cfg.model.chat_template, cfg.agent.args["env_args"]["data"]) == (
        "../recipes/model", "../recipes/chat.jinja", "../recipes/rows.jsonl")
    assert cfg.eval.agent_args["env_args"]["data"] == {"test": "../recipes/rows.jsonl",
                                                       "x": "nowhere"}   # {split: file} too
    assert cfg.sft.data == "../recipes/rows.jsonl"
    (elsewhere / "model").symlink_to(tiny_model_dir)      # one that exists from cwd stays
    assert load_config("../recipes/r.yaml").model.path == "model"
