"""Weights & Biases metric sink. Offline by default (no network; files in `RUN_DIR/wandb`,
upload later with `wandb sync`); `wandb.mode: online` (or `WANDB_MODE=online`) logs live.
A key the recipe leaves empty falls back to W&B's own variable (`WANDB_PROJECT`, ...). The run id
is kept in `RUN_DIR/wandb-run-id`, so `molt run --resume` continues the same W&B run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molt_core import hookimpl
from molt_core.config import to_dict


@dataclass
class WandbConfig:
    project: str = ""                    # empty: $WANDB_PROJECT, else molt
    entity: str = ""                     # empty: $WANDB_ENTITY, else your default entity
    mode: str = ""                       # offline | online | disabled; empty: $WANDB_MODE, else offline


class WandbSink:
    def __init__(self, run_dir: Path | None, cfg: Any) -> None:
        import wandb
        o, config = cfg.plugins["wandb"], {k: v for k, v in to_dict(cfg).items() if k != "plugins"}
        saved = run_dir and Path(run_dir) / "wandb-run-id"
        run_id = saved.read_text().strip() if saved and saved.is_file() else None
        env = os.environ.get
        self.run = wandb.init(project=o.project or env("WANDB_PROJECT", "molt"),
                              entity=o.entity or None, mode=o.mode or env("WANDB_MODE", "offline"),
                              dir=env("WANDB_DIR", str(run_dir or ".")),
                              name=env("WANDB_NAME", run_dir and run_dir.name), config=config,
                              id=run_id, resume="allow" if run_id else None,
                              settings=wandb.Settings(quiet=True))
        if saved:
            saved.write_text(self.run.id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        import wandb
        self.run.log({"completions": wandb.Table(columns=list(rows[0]), data=[
            list(r.values()) for r in rows])}, step=step)

    def close(self) -> None:
        self.run.finish()


@hookimpl
def molt_config_sections() -> dict:
    return {"wandb": WandbConfig}


@hookimpl
def molt_metric_sinks() -> dict:
    return {"wandb": WandbSink}
