"""Checkpoints, lossless resume and HF export (issue 12), with real Ray, gloo, DCP, subprocess
drivers killed with SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from transformers import get_cosine_schedule_with_warmup

from molt_core.run import checkpoint
from molt_core.cli import load
from molt_core.config import ConfigError
from molt_core.trainer import train

TESTS = Path(__file__).parent
TIMING = ("time", "elapsed_s", "train/fwd_bwd_s", "train/optim_s", "memory/")   # not reproducible


def _recipe(tmp_path: Path, model: Path, **sections) -> str:
    data = yaml.safe_load(open(TESTS.parent / "recipes/cpu/next_letter.yaml"))
    data["model"]["path"] = str(model)
    data["rollout"].update(groups_per_step=4, group_size=4)
    data["trainer"].update(steps=8, save_every=4)
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _molt(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    ray_tmp = tempfile.mkdtemp(prefix="rayck", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "molt_tools", *args], capture_output=True,
                          text=True, timeout=900, env=env)


def _run_dir(out: Path) -> Path:
    (d,) = [p for p in out.iterdir() if p.is_dir()]
    return d


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _state(ckpt: Path) -> dict:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    def flat(d: dict, pre: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{pre}{k}.") if isinstance(v, dict) else {f"{pre}{k}": v})
        return out
    return flat(_load_state_dict_from_keys(None, checkpoint_id=str(ckpt / "policy")))


def test_resume_after_kill_is_bit_identical_sync(ray_local, tiny_chars_dir, tmp_path):
    """8 steps straight == 4 steps, kill -9 inside the next checkpoint write, --resume, 4 more:
    parameters, AdamW state, the lr schedule's position (cosine, warmup 3: step 4 is mid-decay)
    and metrics rows identical; the torn write left step 4 usable.
    kill_plugin's molt_state_dict / molt_load_state_dict carry its counter across the resume."""
    recipe = _recipe(tmp_path, tiny_chars_dir, trainer={"lr_schedule": "cosine", "warmup_steps": 3})
    cfg, plugins = load(recipe, [f"out_dir={tmp_path / 'a'}"])
    straight = tmp_path / "a" / "run"
    straight.mkdir(parents=True)
    train(cfg, plugins, straight, progress=False)

    first = _molt("run", recipe, f"out_dir={tmp_path / 'b'}", "--plugin", "kill_plugin",
                  "--no-progress", env={"MOLT_TEST_KILL_IN_SAVE": "2"})
    assert first.returncode == -9, first.stderr[-3000:]
    run = _run_dir(tmp_path / "b")
    torn = run / "checkpoints" / ".tmp-step_000008"
    assert (torn / "policy").is_dir() and not (torn / "driver.pt").exists()
    assert checkpoint.latest(run).name == "step_000004"
    assert len(_rows(run)) == 8        # steps 4-7 were logged before the kill; resume redoes them

    second = _molt("run", "--resume", str(run), "--plugin", "kill_plugin", "--no-progress")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "kill_plugin restored: {'saves': 1}" in second.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000004",
                                                                        "step_000008"]
    a, b = _state(straight / "checkpoints/step_000008"), _state(run / "checkpoints/step_000008")
    assert a.keys() == b.keys() and any(k.startswith("optim.state.") for k in a)
    differ = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                   else a[k] == b[k])]
    assert differ == []
    assert _rows(run) == _rows(straight)
    assert [r["step"] for r in _rows(run)] == list(range(1, 9))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.trainer.lr)
    cosine = get_cosine_schedule_with_warmup(opt, 3, 8)
    lrs = []
    for _ in range(8):                     # HF's cosine schedule, the lr each step used
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        cosine.step()
    assert [r["train/lr"] for r in _rows(run)] == lrs and lrs[4] < lrs[3] == cfg.trainer.lr
    meta = json.loads((run / "meta.json").read_text())
    assert meta["resumed"][0]["checkpoint"].endswith("step_000004")


def test_resume_async_trains_every_task_once(tiny_chars_dir, tmp_path):
    """Async pool: kill -9 after step 5 (checkpoint at 4 holds finished and running groups),
    resume: no group id is trained twice and none is lost (trained or still in the final pool)."""
    recipe = _recipe(tmp_path, tiny_chars_dir, rollout={"scheme": "async", "max_staleness": 2,
                                                        "max_inflight_groups": 8},
                     algorithm={"correction": "tis"})
    tasks = tmp_path / "tasks.jsonl"
    env = {"MOLT_TEST_TASKS": str(tasks)}
    first = _molt("run", recipe, f"out_dir={tmp_path / 'c'}", "--plugin", "kill_plugin",
                  "--no-progress", env={**env, "MOLT_TEST_KILL_AFTER_STEP": "5"})
    assert first.returncode == -9, first.stderr[-3000:]
    run = _run_dir(tmp_path / "c")
    saved = torch.load(checkpoint.latest(run) / "driver.pt", weights_only=True)["generator"]
    assert saved["buffer"] or saved["reissue"]         # the pool was not empty at the save
    second = _molt("run", "--resume", str(run), "--plugin", "kill_plugin", "--no-progress",
                   env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    by_step = {}
    for line in tasks.read_text().splitlines():     # a redone step's record replaces the old one
        rec = json.loads(line)
        by_step[rec["step"]] = rec["groups"]
    assert sorted(by_step) == list(range(1, 9))
    trained = [g for s in range(1, 9) for g in by_step[s]]
    assert len(trained) == len(set(trained)) == 8 * 4
    end = torch.load(run / "checkpoints/step_000008/driver.pt", weights_only=True)["generator"]
    pool = {t["group_id"] for g in end["buffer"] for t in g} | set(end["reissue"])
    assert not pool & set(trained)
    assert set(range(max(trained) + 1)) <= set(trained) | pool
    assert [r["step"] for r in _rows(run)] == list(range(1, 9))


def test_resume_rejects_a_changed_config(tiny_chars_dir, tmp_path):
    recipe = _recipe(tmp_path, tiny_chars_dir)
    cfg, _ = load(recipe, [])
    saved = yaml.safe_load(yaml.safe_dump(__import__("molt_core.config").config.to_dict(cfg)))
    cfg2, _ = load(recipe, ["trainer.steps=20", "trainer.save_every=2"])
    checkpoint.check_resume_config(dict(saved), cfg2)        # safe keys: accepted
    cfg3, _ = load(recipe, ["trainer.lr=0.5", "trainer.steps=20"])
    with pytest.raises(ConfigError, match=r"trainer\.lr \(0\.001 -> 0\.5\).*may change only"):
        checkpoint.check_resume_config(dict(saved), cfg3)


SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_new_tokens": 4}


def _engine_batch(model_dir: Path, n: int = 6) -> dict[str, torch.Tensor]:
    """Rollouts of the gym agent (colours env: images, for VL models; next_letter otherwise)
    sampled by the embedded engine, collated as the trainer gets them."""
    import asyncio

    from transformers import AutoTokenizer

    from molt_core.engines.hf import HFEngine
    from molt_core.contracts import RolloutContext
    from molt_core.multimodal import is_vl
    from molt_core.plugins import build_plugins
    from molt_core.trajectory import collate
    from molt_gym import GymAgent
    from transformers import AutoConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    vl = is_vl(AutoConfig.from_pretrained(model_dir))
    env = {"env": "colours", "env_args": {"turns": 2}} if vl else {"env": "next_letter",
                                                                    "chat_template": False}
    agent = GymAgent(type("C", (), {"model": type("M", (), {"path": str(model_dir)})})(), tok,
                     build_plugins(), max_turns=2, **env)
    engine = HFEngine(str(model_dir), seed=0)

    async def run():
        return await asyncio.gather(*(agent.rollout(RolloutContext(
            0, i, 100 + i, dict(SAMPLING), lambda p, s=None, images=None: engine.generate(
                p, s or SAMPLING, images), tok)) for i in range(n)))
    trajs = asyncio.run(run())
    batch = collate(trajs, [[float(i % 3 - 1)] * len(t) for i, t in enumerate(trajs)],
                    tok.pad_token_id or 0)
    batch["versions"] = batch["versions"].clamp(max=0)
    return batch


def _pg_loss(logprobs, behavior_logprobs, advantages, mask):
    return -(logprobs * advantages), {}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_vl"])
def test_export_matches_the_trainer(ray_local, tmp_path_factory, arch):
    """A trained policy's checkpoint exported as an HF dir: it loads with transformers (the
    Auto class for its kind) and gives the trainer's log-probs (fp32, <= 1e-5)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from molt_tools.tiny import CHARSET
    from molt_core.config import TrainerConfig
    from molt_core.policy.logprobs import token_logprobs
    from molt_core.policy.handle import Policy
    from molt_core.policy.objective import TrainStep
    from molt_tools.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp(arch)
    model_dir = build_tiny_model(tmp / "model", arch, charset=CHARSET)
    batch = _engine_batch(model_dir)
    policy = Policy(str(model_dir), TrainerConfig(lr=1e-2, timeout_s=120.0))
    try:
        policy.train(batch, TrainStep(_pg_loss, correction="none"))
        # routing recomputed on both sides (the engine's recorded routing predates the update)
        trainer_lp = policy.logprobs({k: v for k, v in batch.items() if k != "routed_experts"})
        policy.save_checkpoint(str(tmp / "ckpt"))
    finally:
        policy.shutdown()
    out = checkpoint.export_hf(checkpoint._policy_tensors(tmp / "ckpt" / "policy"), model_dir,
                               tmp / "export")
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja",
            "generation_config.json"} <= names
    auto = AutoModelForImageTextToText if arch == "qwen3_vl" else AutoModelForCausalLM
    model = auto.from_pretrained(out, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(out).chat_template
    original = auto.from_pretrained(model_dir, dtype=torch.float32)
    moved = [n for n, p in model.named_parameters()
             if not torch.equal(p, original.get_parameter(n))]
    assert moved                                     # the export holds the trained weights
    rows = {k: v for k, v in batch.items() if k != "routed_experts"}
    with torch.no_grad():
        lp = token_logprobs(model, rows, 1.0, 1024, moe_routing="off").logprobs
    mask = batch["loss_mask"]
    assert mask.sum() > 0
    assert (lp - trainer_lp)[mask].abs().max() <= 1e-5


def test_a_plugin_state_no_checkpoint_can_hold_stops_the_run_after_the_weights(tiny_chars_dir,
                                                                                 tmp_path):
    """molt_state_dict returning a lambda: the first checkpoint (here the run's last, save_every
    0) keeps the weights, then the run stops with one line naming the plugin (issue 41.11; before:
    a pickling traceback at the end and no checkpoint at all)."""
    recipe = _recipe(tmp_path, tiny_chars_dir, trainer={"steps": 2, "save_every": 0})
    out = _molt("run", recipe, f"out_dir={tmp_path / 'r'}", "--plugin", "unpicklable_plugin")
    assert out.returncode != 0
    err = [line for line in out.stderr.splitlines() if "Traceback" in line or "error:" in line]
    assert len(err) == 1 and "plugin unpicklable_plugin's molt_state_dict returned what a " \
        "checkpoint cannot hold" in err[0], out.stderr[-3000:]
    (ckpt,) = (_run_dir(tmp_path / "r") / "checkpoints").iterdir()
    assert ckpt.name == "step_000002" and (ckpt / "driver.pt").is_file() and _state(ckpt)
