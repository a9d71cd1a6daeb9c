"""`molt sft` against the real TRL `SFTTrainer` (`.venv-trl`, `make venv-trl`): on the tiny model,
the same rendered rows, initial adapters and optimizer, both report the same loss and grad norm
at every step (bench/sft_vs_trl.py, issue 42 acceptance 3). Skipped without .venv-trl."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRL_PY = ROOT / ".venv-trl/bin/python"

pytestmark = pytest.mark.skipif(not TRL_PY.exists(), reason=".venv-trl is absent (`make "
                                "venv-trl`): no parity check against TRL's SFTTrainer")


def _bench():
    spec = importlib.util.spec_from_file_location("sft_vs_trl", ROOT / "bench/sft_vs_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_molt_sft_and_trl_sfttrainer_agree_step_for_step(tiny_model_dir, tmp_path):
    bench = _bench()
    # weight decay and a grad clip that binds on some steps; two micro-batches a step (TRL:
    # gradient accumulation): the loss normalisation over the whole batch is checked too
    a = SimpleNamespace(steps=3, batch=4, micro=2, lr=1e-2, weight_decay=0.1, grad_clip=0.5,
                        rank=4, alpha=8.0, seed=0, threads=1)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in bench.transcripts(16, 0)))
    molt = bench.run_molt(bench.molt_spec(a, str(tiny_model_dir), data, tmp_path))
    trl = bench.run_trl(str(TRL_PY), bench.trl_spec(a, str(tiny_model_dir), tmp_path))
    assert trl["adapters"] > 0 and len(molt["steps"]) == len(trl["steps"]) == 3
    trained = json.loads((tmp_path / "rows.json").read_text())
    assert [len(s) for s in trained] == [4, 4, 4]
    assert all(0 < sum(r["completion_mask"]) < len(r["input_ids"]) for s in trained for r in s)
    for m, t in zip(molt["steps"], trl["steps"]):
        assert m["loss"] == pytest.approx(t["loss"], abs=1e-4)
        assert m["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-3)
    assert molt["steps"][-1]["loss"] != molt["steps"][0]["loss"]     # the weights moved
