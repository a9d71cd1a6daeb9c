"""metrics.jsonl rows, the metric-sink fan-out (`molt_metric_sinks`), the console line per step
and JSON log lines."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from molt_core.cli import load
from molt_core.run.metrics import MetricsSink, configure_logging
from molt_core.plugins import PluginError
from molt_core.trainer import rollout_metrics
from molt_core.trajectory import Trajectory


class Memory:
    def __init__(self) -> None:
        self.rows, self.closed = [], False

    def log(self, step, metrics):
        self.rows.append((step, metrics))

    def close(self):
        self.closed = True


def test_rows_carry_time_and_fan_out_to_sinks(tmp_path, monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    configure_logging(fmt="json")
    mem = Memory()
    sink = MetricsSink(tmp_path, 2, show=False, sinks=[mem])
    for step in (1, 2):          # updates done: shown as 1/2, 2/2
        sink.log(step, {"reward/mean": torch.tensor(0.5 * (step - 1)), "time/step_s": 0.1, "note": "x",
                        "loss": 2.0})
    sink.close()
    configure_logging()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward/mean"] == 0.5
    assert rows[0]["time"] <= rows[1]["time"]
    assert 0 <= rows[0]["time/elapsed_s"] <= rows[1]["time/elapsed_s"]
    # namespaced names; the old flat ones kept beside them for one release, not for the sinks
    assert rows[1]["train/loss"] == rows[1]["loss"] and rows[1]["elapsed_s"] > 0
    assert mem.closed and [s for s, _ in mem.rows] == [1, 2]
    assert mem.rows[1][1] == {"reward/mean": 0.5, "time/step_s": 0.1, "train/loss": 2.0,
                              "time/elapsed_s": rows[1]["time/elapsed_s"]}
    lines = [json.loads(line) for line in err.getvalue().splitlines()]     # JSON lines
    assert [(e["event"], e["step"], e["reward"]) for e in lines] == [("step", "1/2", 0.0),
                                                                      ("step", "2/2", 0.5)]


def test_unknown_sink_is_a_config_error(tiny_model_dir):
    with pytest.raises(PluginError, match="unknown metric_sink 'memory'"):
        load(None, [f"model.path={tiny_model_dir}", "log.sinks=[memory]"])


def test_reward_spread_metrics():
    trajs = []
    for group, rewards in enumerate([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]]):
        for r in rewards:
            trajs.append(Trajectory(group_id=group, reward=r))
    rewards = torch.tensor([t.reward for t in trajs])
    m = rollout_metrics(trajs, torch.zeros(6))
    assert m["reward/zero_std_groups"] == pytest.approx(2 / 3)
    assert m["reward/std"] == pytest.approx(rewards.std(unbiased=False).item())


def test_engine_busy_time_counts_generation_the_driver_did_not_wait_for():
    import asyncio
    from types import SimpleNamespace

    from molt_core.rollout.client import EngineClient
    from molt_core.trajectory import Completion

    async def generate_batch(prompts, samplings, **kw):   # stand-in engine (the client's view
        await asyncio.sleep(0.3)                            # of a Ray actor): fixed time per batch
        return [Completion([1], [-0.1], [0]) for _ in prompts]

    engine = SimpleNamespace(generate_batch=SimpleNamespace(remote=generate_batch))
    client = EngineClient([engine, engine], 30.0)

    async def main():
        assert client.busy_s() == 0.0
        await asyncio.gather(*(client.generate([i], {}) for i in range(4)))   # both engines
        await client.generate([5], {})                                          # one engine
        return client.busy_s(), client.busy_s()

    first, second = asyncio.run(main())
    assert first >= (0.3 + 0.3 + 0.3) / 2 and second == 0.0    # mean over the two engines


def test_trainer_peak_memory_is_the_ranks_own_not_a_forking_parents():
    """`memory/trainer_peak_gib` on CPU is this process's high-water RSS: a rank started by a
    large process (a bench, a notebook) reports its own, not the parent's kept across exec."""
    import subprocess
    held = bytearray(1536 * 2**20)
    held[::4096] = b"\1" * (len(held) // 4096)          # touched: resident in this process
    code = "from molt_core.policy.worker import _peak_gib; print(_peak_gib())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True, timeout=120).stdout)
    assert 0.05 < child < 1.0, child             # torch imported: ~0.3 GiB; the parent: > 1.5
    del held
