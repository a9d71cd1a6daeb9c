"""Test fixture at the root (test code, beside the RL path): one real run for every shipped
sink's test, the toy recipe logging to all three sinks for 3 steps, then `molt run --resume`
to 5 (W&B project and MLflow experiment from their environment variables; the recipe sets
neither)."""

from __future__ import annotations

from pathlib import Path

import pytest

from molt_tools.tiny import CHARSET, build_tiny_model
from molt_core.run.metrics import RENAMED
from real_runs import molt, real_run, rows

ENV = {"WANDB_PROJECT": "from-env", "WANDB_SILENT": "true", "MLFLOW_EXPERIMENT_NAME": "env-exp"}


@pytest.fixture(scope="session")
def sink_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sink-run")
    model = build_tiny_model(root / "tiny", "qwen3", charset=CHARSET)
    run = real_run(root, model, "log.sinks=[tensorboard,wandb,mlflow]", "trainer.steps=3",
                   env=ENV)
    resumed = molt("run", "--resume", str(run), "trainer.steps=5", "--no-progress", env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for row in rows(run):           # the namespaced names, the old flat ones kept as aliases
        if "reward/mean" in row:
            assert {"train/loss", "train/grad_norm", "train/entropy", "policy/version",
                    "time/elapsed_s", "loss", "grad_norm", "entropy", "version"} <= row.keys()
            assert all(row[old] == row[RENAMED[old]] for old in row.keys() & RENAMED.keys())
    return run
