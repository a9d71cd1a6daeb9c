"""The deterministic mode of the async and partial schemes (`rollout.deterministic`): batch i is
sampled by exactly the weights of version max(0, i - max_staleness) (partial: each response's
second half by the next version), so one seed fixes the run bit for bit (twice the same run; a
resumed run equals the straight one). Real Ray, HF engine, FSDP2 trainer."""

from __future__ import annotations

import pytest
import torch

from molt_core.cli import load
from molt_core.trainer import train
from test_checkpoint import _rows, _state

RECIPE = "recipes/cpu/reverse.yaml"


def _run(model, run_dir, scheme, *extra: str, resume=None) -> list[dict]:
    cfg, plugins = load(RECIPE, [f"model.path={model}", "trainer.steps=8", "trainer.save_every=4",
                                 "rollout.groups_per_step=4", "rollout.group_size=4",
                                 f"rollout.scheme={scheme}", "rollout.deterministic=true",
                                 "algorithm.correction=tis", "trainer.lr=0.02",
                                 "check.consistency_every=3", "log.trajectories_every=0", *extra])
    run_dir.mkdir(parents=True, exist_ok=True)
    train(cfg, plugins, run_dir, progress=False, resume=resume)
    return _rows(run_dir)


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys() and any(k.startswith("optim.state.") for k in a)
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                 else a[k] == b[k])]


@pytest.mark.parametrize(("scheme", "lag"), [("async", 1), ("async", 2), ("partial", 1)])
def test_deterministic_runs_and_resume_are_bit_identical(ray_local, tiny_chars_dir, tmp_path,
                                                         scheme, lag):
    a = _run(tiny_chars_dir, tmp_path / "a", scheme, f"rollout.max_staleness={lag}")
    b = _run(tiny_chars_dir, tmp_path / "b", scheme, f"rollout.max_staleness={lag}")
    assert [r["step"] for r in a] == list(range(1, 9))
    for i, r in enumerate(a):        # batch i: sampled by version max(0, i - lag), all of it ...
        lags = {int(k.rsplit("/", 1)[1]) for k in r if k.startswith("rollout/version_lag/")}
        if scheme == "async" or i < lag:
            assert lags == {min(i, lag)} and r["rollout/multi_version"] == 0, (i, r)
        else:          # ... partial: the first 2 of 4 tokens; the rest by the next version
            assert lags == {lag, lag - 1} and r["rollout/multi_version"] > 0.5, (i, r)
    assert len({r["reward/mean"] for r in a}) > 1
    assert a == b
    sa, sb = _state(tmp_path / "a/checkpoints/step_000008"), _state(
        tmp_path / "b/checkpoints/step_000008")
    assert _differ(sa, sb) == []
    # resumed at step 4 (the pool's finished batches and the engine RNG in the checkpoint;
    # nothing draws before the restore): steps 4-7 and the final weights as straight through
    c = _run(tiny_chars_dir, tmp_path / "c", scheme, f"rollout.max_staleness={lag}",
             resume=tmp_path / "a/checkpoints/step_000004")
    assert c == a[4:]
    sc = _state(tmp_path / "c/checkpoints/step_000008")
    assert _differ(sa, sc) == []
