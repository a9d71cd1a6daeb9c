"""Verified weight syncs (issue 25 item 12): bucket checksums on both ends and a canary text scored
by every engine and the trainer after a sync. Real fsdp2 trainer, real HF engines (Ray actors),
real runs (`train`); the corruption is the real engine's, one parameter perturbed
(tests/corrupt_plugin.py)."""

from __future__ import annotations

import pytest
import torch

from common import toy_recipe
from molt_core import weight_sync
from molt_core.cli import load
from molt_core.trainer import train
from molt_core.weight_sync import WeightMismatchError


def test_checksums_are_exact_per_tensor_and_see_one_changed_element():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).bfloat16()),
             ("c", torch.arange(5)), ("d", torch.tensor(1.5, dtype=torch.float16)),
             ("e", torch.zeros(0, 4)), ("f", torch.randn(4, 4, generator=g).t()),
             ("g", torch.tensor([True, False, True]))]
    sums = weight_sync.checksums(named)
    assert len(sums) == len(named) and all(isinstance(s, int) for s in sums)
    metas, flat = weight_sync.pack(named)          # the bytes a transport carries: same sums
    assert weight_sync.checksums(weight_sync.unpack(flat, metas)) == sums
    for i, (name, t) in enumerate(named):
        if t.numel() and t.dtype != torch.bool:
            bad = t.contiguous().clone()
            bad.view(-1)[bad.numel() // 2] += 1
            assert weight_sync.checksums([(name, bad)])[0] != sums[i], name


def run(tmp_path, model, steps: int, *args: str) -> list[dict]:
    cfg, plugins = load(toy_recipe(tmp_path, model), [f"trainer.steps={steps}",
                                                     "log.trajectories_every=0",
                                                     "check.canary_every=1", *args],
                        ["corrupt_plugin"])
    assert cfg.engine.name == "hf_corrupt"
    return train(cfg, plugins, tmp_path, progress=False)


def test_a_corrupted_bucket_fails_its_sync_by_checksum(ray_local, tiny_chars_dir, tmp_path):
    """The engine perturbs one parameter of a bucket it received from version 2 on: the second
    sync fails (after a second push), naming the engine, the parameter and its bucket."""
    with pytest.raises(WeightMismatchError, match=r"version 2: engine 0 .* 1 parameter\(s\), "
                       r"first 'model.norm.weight' of bucket 0 \(checksum -?\d+, sent -?\d+\)"):
        run(tmp_path, tiny_chars_dir, 4, "engine.args.where=bytes")


def test_a_parameter_changed_after_the_load_fails_the_canary(ray_local, tiny_chars_dir,
                                                             tmp_path):
    """The engine perturbs one parameter after loading (the bucket checksums match): the canary
    of the same sync fails, naming the engine, the gap and the parameter."""
    with pytest.raises(WeightMismatchError, match=r"version 2: engine 0 .* canary text up to "
                       r"[\d.e+-]+ away .* its parameter 'model.norm.weight' \(and 0 more\)"):
        run(tmp_path, tiny_chars_dir, 4, "engine.args.where=load")


@pytest.mark.parametrize("where", ["bytes", "load"])
def test_a_transient_mismatch_is_counted_and_pushed_again(ray_local, tiny_chars_dir, tmp_path,
                                                          where):
    history = run(tmp_path, tiny_chars_dir, 4, f"engine.args.where={where}",
                  "engine.args.times=1")
    # version 2's push (after step 1) meets it: counted in step 1's row, logged after the push
    assert [h["faults/weight_sync_mismatches"] for h in history] == [0, 1, 1, 1]
    assert 0 <= history[-1]["check/canary_max_abs"] < 1e-4     # fp32: the same forward


def test_by_default_the_canary_checks_the_first_sync_and_every_tenth(ray_local, tiny_chars_dir,
                                                                    tmp_path):
    """A load that corrupts from the first sync on is caught there (`check.canary_every=10`)."""
    with pytest.raises(WeightMismatchError, match=r"version 1: engine 0 .* canary text"):
        run(tmp_path, tiny_chars_dir, 2, "engine.args.where=load", "engine.args.from_version=1",
            "check.canary_every=10")
    (tmp_path / "late").mkdir()
    history = run(tmp_path / "late", tiny_chars_dir, 4, "engine.args.where=load",
                  "check.canary_every=10")      # corrupted from version 2: unseen until 11
    assert history[-1]["faults/weight_sync_mismatches"] == 0


def test_bf16_runs_with_default_tolerances_and_still_catches_a_corrupted_load(
        ray_local, tiny_chars_dir, tmp_path):
    """bf16 numerics (engine vs trainer, the same bytes) pass the canary and the per-step
    forward check at their default tolerance; one parameter changed after the load does not."""
    history = run(tmp_path, tiny_chars_dir, 3, "model.dtype=bfloat16", "engine.args.times=0",
                  "check.consistency_every=1")
    assert history[-1]["faults/weight_sync_mismatches"] == 0
    (tmp_path / "bad").mkdir()
    with pytest.raises(WeightMismatchError, match=r"version 2: engine 0 .* canary text"):
        run(tmp_path / "bad", tiny_chars_dir, 3, "model.dtype=bfloat16", "engine.args.where=load")

