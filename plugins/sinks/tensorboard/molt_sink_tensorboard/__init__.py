"""TensorBoard metric sink: event files in `RUN_DIR/tensorboard` (`tensorboard --logdir RUN_DIR`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from molt_core import hookimpl


class TensorBoardSink:
    def __init__(self, run_dir: Path | None, cfg: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(Path(run_dir or ".") / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


@hookimpl
def molt_metric_sinks() -> dict:
    return {"tensorboard": TensorBoardSink}
