"""TensorBoard metric sink: event files in `RUN_DIR/tensorboard` (`tensorboard --logdir RUN_DIR`).
A resumed run writes to the same directory; steps it redoes replace the earlier ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from molt_core import hookimpl


class TensorBoardSink:
    def __init__(self, run_dir: Path | None, cfg: Any) -> None:
        self.dir, self.writer = str(Path(run_dir or ".") / "tensorboard"), None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is None:       # purge_step: hide events a resumed run logs again
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(self.dir, purge_step=step or None)
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@hookimpl
def molt_metric_sinks() -> dict:
    return {"tensorboard": TensorBoardSink}
