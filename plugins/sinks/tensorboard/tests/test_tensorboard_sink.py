"""The TensorBoard sink round-trips a real run's metrics (and its resume, in the same log dir):
read back with TensorBoard's own event reader."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from real_runs import history


def test_a_real_run_and_its_resume_read_back(sink_run):
    acc = EventAccumulator(str(sink_run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    expected = history(sink_run)
    assert set(acc.Tags()["scalars"]) == set(expected)
    for key, want in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key
