"""The MLflow sink round-trips a real run's metrics through a local file store (no server), and
the resumed run continues the same MLflow run."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow import MlflowClient

from molt_core.config import Config
from molt_core.plugins import build_plugins
from molt_sink_mlflow import MlflowConfig
from real_runs import history, saved_completions


def test_a_real_run_and_its_resume_land_in_one_mlflow_run(sink_run, monkeypatch):
    """`time` and `time/*` once collided in the file store (`[Errno 20] Not a directory`)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((sink_run / "mlruns").resolve().as_uri())
    run_id = (sink_run / "mlflow-run-id").read_text()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == sink_run.name
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "env-exp"                              # $MLFLOW_EXPERIMENT_NAME
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [run_id]
    expected = history(sink_run)
    assert set(run.data.metrics) == set(expected)           # namespaced names only
    assert [s for s, _ in expected["reward/mean"]] == list(range(1, 6))   # step = updates done
    for key, want in expected.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert got == want, key
    # each saved step's rollouts, appended to one table artifact (a step column added)
    table = json.loads(Path(client.download_artifacts(run_id, "completions.json")).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward", "reference"]
    got: dict = {}
    for step, *row in table["data"]:
        got.setdefault(step, []).append(tuple(row[:3]))
    assert {s: sorted(rows) for s, rows in got.items()} == saved_completions(sink_run)


def test_the_recipe_beats_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    cfg = Config()
    cfg.plugins = {"mlflow": MlflowConfig(experiment="exp")}
    sink = build_plugins().get("metric_sink", "mlflow")(tmp_path, cfg)
    sink.log(0, {"time/step_s": 1.5})
    sink.close()
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    assert client.get_experiment(client.get_run(sink.run_id).info.experiment_id).name == "exp"
