"""The W&B sink in offline mode (no network) round-trips a real run's metrics, and `--resume`
continues the same W&B run: each `.wandb` file is read back record by record (LevelDB log
framing of W&B's protobuf records)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2 as pb

from molt_core.config import Config
from molt_core.plugins import build_plugins
from molt_sink_wandb import WandbConfig
from real_runs import history, saved_completions


def records(path: Path) -> list:
    data, pos, buf, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:          # block trailer padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):                   # full record, or the last fragment of one
            out.append(pb.Record.FromString(buf))
            buf = b""
    return out


def read_run(path: Path, rows: int) -> tuple[list, list]:
    """(records, [(step, {key: value})]); W&B's service process may still be flushing the file
    after `finish` returns (seen once in the full suite), so read until `rows` are there."""
    for _ in range(300):
        try:
            recs = records(path)
        except DecodeError:          # a record still being written
            recs = []
        steps = [(r.history.step.num, {k: v for k, v in (
                     (i.key or "/".join(i.nested_key), json.loads(i.value_json))
                     for i in r.history.item) if not k.startswith("_")})
                 for r in recs if r.WhichOneof("record_type") == "history"]
        if len(steps) >= rows:
            return recs, steps
        time.sleep(0.1)
    return recs, steps


def test_a_real_run_and_its_resume_are_one_wandb_run(sink_run):
    first, second = sorted(sink_run.glob("wandb/offline-run-*/run-*.wandb"))
    (rec1, steps1), (rec2, steps2) = read_run(first, 3), read_run(second, 2)
    runs = [next(r.run for r in recs if r.WhichOneof("record_type") == "run")
            for recs in (rec1, rec2)]
    assert {r.run_id for r in runs} == {(sink_run / "wandb-run-id").read_text()}
    assert all(r.project == "from-env" and r.display_name == sink_run.name for r in runs)
    got: dict = {}
    for step, items in steps1 + steps2:
        for k, v in items.items():
            got.setdefault(k, []).append((step, v))
    tables = {k: got.pop(k) for k in [k for k in got if k.startswith("completions/")]}
    assert got == history(sink_run)
    # each saved step's rollouts: a W&B table (a file of the run, named in the history row)
    expected = saved_completions(sink_run)
    assert tables["completions/_type"] == [(s, "table-file") for s in sorted(expected)]
    for step, path in tables["completions/path"]:
        (path,) = sink_run.glob(f"wandb/offline-run-*/files/{path}")
        table = json.loads(path.read_text())
        assert table["columns"] == ["prompt", "completion", "reward", "reference"]
        assert sorted((p, c, r) for p, c, r, _ in table["data"]) == expected[step], step


def test_the_recipe_beats_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    cfg = Config()
    cfg.plugins = {"wandb": WandbConfig(project="p")}
    sink = build_plugins().get("metric_sink", "wandb")(tmp_path, cfg)
    sink.log(0, {"reward/mean": 0.25})
    sink.close()
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    recs, _ = read_run(path, 1)
    assert next(r.run for r in recs if r.WhichOneof("record_type") == "run").project == "p"
