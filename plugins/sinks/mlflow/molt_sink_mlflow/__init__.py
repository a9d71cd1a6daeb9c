"""MLflow metric sink: a local file store in `RUN_DIR/mlruns` by default (`mlflow ui
--backend-store-uri RUN_DIR/mlruns`), or `mlflow.tracking_uri` / `$MLFLOW_TRACKING_URI`. The run
id is kept in `RUN_DIR/mlflow-run-id`, so `molt run --resume` continues the same MLflow run."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molt_core import hookimpl


@dataclass
class MlflowConfig:
    tracking_uri: str = ""               # empty: $MLFLOW_TRACKING_URI, else file store RUN_DIR/mlruns
    experiment: str = ""                 # empty: $MLFLOW_EXPERIMENT_NAME, else molt


class MlflowSink:
    def __init__(self, run_dir: Path | None, cfg: Any) -> None:
        from mlflow import MlflowClient
        o, root = cfg.plugins["mlflow"], Path(run_dir or ".").resolve()
        uri = o.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (root / "mlruns").as_uri()
        if uri.startswith("file:"):   # MLflow 3 keeps the file store but wants an explicit opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        saved = run_dir and root / "mlflow-run-id"
        if saved and saved.is_file():
            self.run_id = saved.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = o.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", "molt")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=root.name).info.run_id
        if saved:
            saved.write_text(self.run_id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, [Metric(k, v, now, step) for k, v in metrics.items()])

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """Appended to the artifact `completions.json` (MLflow's table: Evaluation / Artifacts)."""
        self.client.log_table(self.run_id, {"step": [step] * len(rows), **{
            k: [r[k] for r in rows] for k in rows[0]}}, "completions.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@hookimpl
def molt_config_sections() -> dict:
    return {"mlflow": MlflowConfig}


@hookimpl
def molt_metric_sinks() -> dict:
    return {"mlflow": MlflowSink}
