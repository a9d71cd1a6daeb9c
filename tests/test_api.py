"""The Python API (issue 27 item 4) and docs/data.md's example: a JSONL file and a reward function
in TRL's form train from the recipe alone (`molt run`) and from `molt_core.train`."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

import molt_core
from molt_tools.commands import main

DOC = Path(__file__).parents[1] / "docs" / "data.md"


def test_import_molt_core_is_light():
    code = ("import sys, molt_core; print([m for m in ('torch', 'ray', 'transformers') "
            "if m in sys.modules], callable(molt_core.train))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.split() == ["[]", "True"]


def test_docs_example_trains_from_the_recipe_and_the_python_api(tiny_chars_dir, tmp_path,
                                                                monkeypatch, capsys):
    blocks = re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', DOC.read_text(), re.S)
    assert {t for t, _ in blocks} == {"data/letters.jsonl", "rewards.py", "letters.yaml",
                                      "train.py"}
    for title, body in blocks:
        (tmp_path / title).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / title).write_text(body)
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "tiny-chars").symlink_to(tiny_chars_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])

    # the recipe alone; a reward function returning NaN is dropped and counted as for any env
    (tmp_path / "extra.py").write_text("def nan_for_h(completion, answer):\n"
                                       "    return float('nan') if answer == 'h' else 0.0\n")
    assert main(["run", "letters.yaml", "trainer.steps=1", "--no-progress", "agent.args.env_args"
                 ".reward={'rewards:next_letter': 1, './extra.py:nan_for_h': 1}"]) == 0
    assert "reward: first step" in capsys.readouterr().out
    (cli_run,) = (tmp_path / "runs").iterdir()
    (last,) = [json.loads(r) for r in (cli_run / "metrics.jsonl").read_text().splitlines()]
    assert last["rollout/dropped/nonfinite_reward"] > 0
    cell = runpy.run_path("train.py")                          # the notebook cell, verbatim
    run = cell["run"]
    steps = [r for r in run.history if "reward/mean" in r]
    assert len(steps) == 3 and (run.run_dir / "metrics.jsonl").is_file()
    assert all(0.0 <= r["reward/mean"] <= 1.1 for r in steps)
    (saved,) = (run.run_dir / "trajectories").glob("*.parquet")
    infos = [json.loads(i) for i in pq.read_table(saved, columns=["info"])["info"].to_pylist()]
    assert {i["row"] for i in infos} == set(range(8))           # one step = 16 groups: 2 epochs
    assert all(set(i) == {"row", "line", "columns", "reward/rewards:next_letter",
                          "reward/rewards:is_letter"} for i in infos)    # line, columns: molt view

    # a Config from load_recipe, changed in Python, is a recipe again (train takes it so)
    cfg = molt_core.load_recipe("letters.yaml", ["trainer.steps=1"])
    cfg.agent.args["env_args"]["reward"] = {"rewards:next_letter": 1.0, "./extra.py:nan_for_h": 1}
    assert molt_core.load_recipe(cfg) == cfg
    model = molt_core.export(run.run_dir, tmp_path / "hf")
    assert (model / "config.json").is_file()
    metrics = molt_core.evaluate(model, "letters.yaml", {
        "agent.args.env_args.test_fraction": 0.5, "eval.prompts": 4, "eval.k": 2,
        "eval.agent_args": {"env_args": {"split": "test"}}})
    assert {"eval/greedy/pass@1", "eval/sampled/pass@2"} <= set(metrics)
    assert isinstance(molt_core.Config(), molt_core.Config)


def test_nested_overrides_merge_key_by_key_as_dotted_keys_do(tiny_chars_dir, tmp_path):
    """{"trainer": {"lr": 0.5}} changes trainer.lr only (it replaced the section: micro-batch
    512 -> the default, transport shm -> broadcast), and equals "trainer.lr=0.5"."""
    recipe = Path(__file__).parents[1] / "recipes/cpu/addition.yaml"
    base = {"model.path": str(tiny_chars_dir), "out_dir": str(tmp_path)}
    nested = molt_core.load_recipe(recipe, {**base, "trainer": {"lr": 0.5}})
    dotted = molt_core.load_recipe(recipe, {**base, "trainer.lr": 0.5})
    assert nested.trainer.lr == 0.5
    assert nested.trainer.micro_batch_size == 512
    assert nested.trainer.weight_sync_transport == "shm"
    assert nested == dotted
