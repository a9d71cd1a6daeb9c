"""The TensorBoard sink round-trips a real run's metrics (and its resume, in the same log dir):
read back with TensorBoard's own event reader."""

from __future__ import annotations

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from real_runs import history, saved_completions


def test_a_real_run_and_its_resume_read_back(sink_run):
    acc = EventAccumulator(str(sink_run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    expected = history(sink_run)
    assert set(acc.Tags()["scalars"]) == set(expected)
    for key, want in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key


def test_each_saved_steps_completions_are_a_text_table(sink_run):
    """The Text tab's `completions`: a Markdown table per step of the saved rollouts."""
    acc = EventAccumulator(str(sink_run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    expected = saved_completions(sink_run)
    events = acc.Tensors("completions/text_summary")
    assert [e.step for e in events] == sorted(expected)
    for e in events:
        head, rule, *lines = e.tensor_proto.string_val[0].decode().split("\n")
        assert head == "| prompt | completion | reward | reference |" and rule == "| --- " * 4 + "|"
        cells = [[c.replace("\\|", "|").replace("<br>", "\n")
                  for c in re.split(r"(?<!\\) \| ", line[2:-2])] for line in lines]
        assert sorted((p, c, float(r)) for p, c, r, _ in cells) == expected[e.step], e.step
        assert all(ref == "" for *_, ref in cells)        # next_letter reports no data row
