"""The MLflow sink round-trips metrics through a local file store (no server)."""

from __future__ import annotations

from mlflow import MlflowClient

from molt_core.config import Config
from molt_core.plugins import build_plugins
from molt_sink_mlflow import MlflowConfig

ROWS = [{"reward/mean": 0.25, "time/step_s": 1.5}, {"reward/mean": 0.75, "time/step_s": 1.25}]


def test_mlflow_sink_round_trips(tmp_path):
    cfg = Config()
    cfg.plugins = {"mlflow": MlflowConfig(experiment="exp")}
    sink = build_plugins().get("metric_sink", "mlflow")(tmp_path, cfg)
    for step, row in enumerate(ROWS):
        sink.log(step, row)
    sink.close()
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    for key in ROWS[0]:
        history = sorted((m.step, m.value) for m in client.get_metric_history(sink.run_id, key))
        assert history == [(s, r[key]) for s, r in enumerate(ROWS)]
