"""Test plugin: loss `nan_at_step_1`, the policy gradient with a NaN loss at step 1 only (the
trainer skips and counts that step)."""

from __future__ import annotations

from molt_core import hookimpl


def nan_at_step_1(logprobs, behavior_logprobs, advantages, mask, step):
    return -(logprobs * advantages) * (float("nan") if step == 1 else 1.0), {}


@hookimpl
def molt_losses():
    return {"nan_at_step_1": nan_at_step_1}
