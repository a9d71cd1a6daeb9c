"""The training loop around the update, on the real loop (HF engine, fsdp2 policy, Ray): a batch
filter that empties the batch skips the update (counted), and several optimizer steps per batch
make the clip act in an async run."""

from __future__ import annotations

import sys

import pytest

from molt_core.cli import load
from molt_core.trainer import train

PLUGIN = '''
from molt_core import hookimpl


@hookimpl
def molt_filter_batch(groups, step):
    return [] if step == 2 else None        # [] is "nothing left", only None is "unchanged"
'''


@pytest.fixture(scope="module")
def history(ray_local, tiny_chars_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    (d / "molt_test_empty_filter.py").write_text(PLUGIN)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(d))
        cfg, plugins = load("recipes/cpu/next_letter.yaml", [
            f"model.path={tiny_chars_dir}", "trainer.steps=3", "rollout.groups_per_step=4",
            "rollout.scheme=async", "algorithm.correction=tis", "rollout.max_staleness=1",
            "trainer.mini_batches=4", "algorithm.loss_args={clip_low: 0.001, clip_high: 0.001}"],
            ["molt_test_empty_filter"])
        yield train(cfg, plugins, None, progress=False)
    sys.modules.pop("molt_test_empty_filter", None)


def test_a_filter_that_empties_the_batch_skips_the_update(history):
    skipped = history[1]
    assert skipped["trainer/empty_batches"] == 1 and "loss" not in skipped
    assert [h["version"] for h in history] == [1, 1, 2]      # no weight push for step 2
    assert "trainer/empty_batches" not in history[0] and history[2]["trainer/empty_batches"] == 1


def test_mini_batches_make_the_clip_act_in_async(history):
    for h in (history[0], history[2]):
        # ratio to pi_prox: 1 in the first mini-batch step, clipped in the later ones
        assert h["clip_fraction"] > 0.05, h
        assert h["is_weight"] > 0


def test_a_rank_in_the_driver_trains_as_its_actor_does(ray_local, tiny_chars_dir):
    """`trainer.in_driver`: one CPU rank in the driver's process (no Ray hop) gives the same run
    as the same rank as a Ray actor, step for step, then hands the process back."""
    import structlog
    import torch
    import torch.distributed as dist

    threads, runs = torch.get_num_threads(), {}
    for in_driver in (True, False):
        cfg, plugins = load("recipes/cpu/next_letter.yaml", [
            f"model.path={tiny_chars_dir}", "trainer.steps=4", "rollout.groups_per_step=4",
            "check.consistency_every=1", f"trainer.in_driver={in_driver}"])
        with structlog.testing.capture_logs() as logs:
            runs[in_driver] = train(cfg, plugins, None, progress=False)
        ready = next(e for e in logs if e["event"] == "cluster_ready")
        assert (ready["rank_nodes"] == "driver") is in_driver
        assert not dist.is_initialized() and torch.get_num_threads() == threads
    keys = ("loss", "grad_norm", "reward/mean", "mismatch/max_abs", "version")
    assert ([[h[k] for k in keys] for h in runs[True]]
            == [[h[k] for k in keys] for h in runs[False]])
    assert runs[True][-1]["version"] == 4 and runs[True][0]["grad_norm"] > 0


def test_a_run_with_no_learning_signal_says_so_once(ray_local, tiny_chars_dir, tmp_path):
    """trainer.dead_run_steps=2: a task no rollout can solve (one reward for all: every group
    flat) warns once, at its second step, and its updates are skipped; the learning next_letter
    run does not warn."""
    import structlog
    (tmp_path / "rows.jsonl").write_text('{"prompt": "after a", "answer": "unreachable"}\n' * 4)
    flat = ["agent.args.env=dataset", "agent.args.env_args={data: %s, test_fraction: 0.0, "
            "reward: 'molt_reward_exact:exact_match'}" % (tmp_path / "rows.jsonl")]
    said = {}
    for name, extra in (("flat", flat), ("learning", [])):
        cfg, plugins = load("recipes/cpu/next_letter.yaml", [
            f"model.path={tiny_chars_dir}", "trainer.steps=4", "rollout.groups_per_step=4",
            "trainer.dead_run_steps=2", *extra])
        with structlog.testing.capture_logs() as logs:
            history = train(cfg, plugins, None, progress=False)
        said[name] = [e["event"] for e in logs if "no learning signal" in e["event"]]
        if name == "flat":
            assert [h["train/no_signal_steps"] for h in history] == [1] * 4
            assert all(h["reward/zero_std_groups"] == 1.0 for h in history)
    assert len(said["flat"]) == 1 and "for 2 steps in a row (to step 2" in said["flat"][0]
    assert "molt sft" in said["flat"][0] and "partial credit" in said["flat"][0]
    assert said["learning"] == [] and history[-1]["train/no_signal_steps"] == 0
