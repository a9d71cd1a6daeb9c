"""Weights & Biases metric sink. Offline by default (no network; files in `RUN_DIR/wandb`,
upload later with `wandb sync`); `wandb.mode: online` logs live."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molt_core import hookimpl
from molt_core.config import to_dict


@dataclass
class WandbConfig:
    project: str = "molt"                # W&B project
    entity: str = ""                     # empty: your default entity
    mode: str = "offline"                # offline | online | disabled


class WandbSink:
    def __init__(self, run_dir: Path | None, cfg: Any) -> None:
        import wandb
        o, config = cfg.plugins["wandb"], {k: v for k, v in to_dict(cfg).items() if k != "plugins"}
        self.run = wandb.init(project=o.project, entity=o.entity or None, mode=o.mode,
                              dir=str(run_dir or "."), name=run_dir and run_dir.name,
                              config=config, settings=wandb.Settings(quiet=True))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


@hookimpl
def molt_config_sections() -> dict:
    return {"wandb": WandbConfig}


@hookimpl
def molt_metric_sinks() -> dict:
    return {"wandb": WandbSink}
