"""The TensorBoard sink round-trips metrics: read back with TensorBoard's own event reader."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from molt_core.config import Config
from molt_core.plugins import build_plugins

ROWS = [{"reward/mean": 0.25, "time/step_s": 1.5}, {"reward/mean": 0.75, "time/step_s": 1.25}]


def test_tensorboard_sink_round_trips(tmp_path):
    sink = build_plugins().get("metric_sink", "tensorboard")(tmp_path, Config())
    for step, row in enumerate(ROWS):
        sink.log(step, row)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    for key in ROWS[0]:
        assert [(e.step, e.value) for e in acc.Scalars(key)] == [(s, r[key])
                                                                 for s, r in enumerate(ROWS)]
