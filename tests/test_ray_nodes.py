"""`ray.address`: a run joins an existing Ray cluster, and custom resources place the trainer ranks
and the engines on different nodes (a `ray.cluster_utils.Cluster`: two real raylets on this box).

The cluster runs in a subprocess (this file as a script) so it cannot collide with the session's
`ray_local`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = Path(__file__).parents[1] / "recipes/cpu/next_letter.yaml"


def test_trainer_and_engines_on_separate_nodes(tmp_path, tiny_chars_dir):
    out = tmp_path / "result.json"
    ray_tmp = tempfile.mkdtemp(prefix="rayn", dir="/tmp")    # unix socket paths stay short
    try:
        proc = subprocess.run([sys.executable, __file__, str(tiny_chars_dir), str(out)],
                              capture_output=True, text=True, timeout=240,
                              env={**os.environ, "RAY_TMPDIR": ray_tmp})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    head, worker = r["head"][:12], r["worker"][:12]
    assert head != worker
    assert r["rank_nodes"] == {head: 1}         # molt_trainer lives on the head node only
    assert r["engine_nodes"] == {worker: 2}     # molt_engine on the worker node only
    assert r["connected_to"] == r["address"]
    assert r["versions"] == [1, 2, 3]           # three steps, each followed by a weight sync


def _main(model: str, out: str) -> None:
    import ray
    import structlog
    from ray.cluster_utils import Cluster

    from molt_core.config import load_config
    from molt_core.plugins import build_plugins
    from molt_core.trainer import train

    tmp = os.environ["RAY_TMPDIR"]
    os.makedirs(os.path.join(tmp, "ray"), exist_ok=True)      # Cluster writes its address here
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"molt_trainer": 2}, "temp_dir": tmp,
        "include_dashboard": False})
    worker = c.add_node(num_cpus=1, resources={"molt_engine": 2})
    c.wait_for_nodes()
    try:
        cfg = load_config(RECIPE, [
            f"model.path={model}", f"ray.address={c.address}", f"out_dir={tmp}/runs",
            "trainer.steps=3", "rollout.groups_per_step=2", "rollout.group_size=4",
            "trainer.num_ranks=1", "engine.num_engines=2", "trainer.resources={molt_trainer: 1}",
            "engine.resources={molt_engine: 1}"])
        plugins = build_plugins()
        with structlog.testing.capture_logs() as logs:
            history = train(cfg, plugins, None, progress=False)
        ready = next(e for e in logs if e["event"] == "cluster_ready")
        result = {"rank_nodes": ready["rank_nodes"], "engine_nodes": ready["engine_nodes"],
                  "head": c.head_node.node_id, "worker": worker.node_id, "address": c.address,
                  "connected_to": ray.get_runtime_context().gcs_address,
                  "versions": [m["version"] for m in history]}
        Path(out).write_text(json.dumps(result))
    finally:
        ray.shutdown()
        c.shutdown()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
