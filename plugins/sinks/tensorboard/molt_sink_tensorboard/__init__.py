"""TensorBoard metric sink: event files in `RUN_DIR/tensorboard` (`tensorboard --logdir RUN_DIR`),
completions tables under Text. A resumed run writes to the same directory; steps it redoes
replace the earlier ones."""

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

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """A Markdown table under the Text tab's `completions`."""
        self.log(step, {})      # the writer
        table = [list(rows[0]), ["---"] * len(rows[0]), *([str(v).replace("|", "\\|").replace(
            "\n", "<br>") for v in r.values()] for r in rows)]
        self.writer.add_text("completions", "\n".join(f"| {' | '.join(c)} |" for c in table), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@hookimpl
def molt_metric_sinks() -> dict:
    return {"tensorboard": TensorBoardSink}
