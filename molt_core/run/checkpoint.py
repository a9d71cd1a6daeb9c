"""Persistence: sharded checkpoints (DCP), lossless resume, plain HF export. A checkpoint is
`RUN_DIR/checkpoints/step_NNNNNN/` (NNNNNN = optimizer steps done), written to a `.tmp-` sibling
and renamed; its files: docs/checkpoints.md, "What a checkpoint holds"."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import yaml

from molt_core.config import Config, ConfigError, to_dict
from molt_core.run import actors
from molt_core.run.metrics import RunDirError, resume_hint
from molt_core.trajectory import ImageInput, Trajectory

__all__ = ["SAFE_TO_CHANGE", "Checkpointer", "CheckpointError", "check_resume_config",
           "export", "export_hf", "init_from", "latest", "prepare_resume", "resolve",
           "resume_recipe", "rng_state", "set_rng_state"]

log = structlog.get_logger("molt.checkpoint")
REPEAT_S = 2.0      # a stop signal again within this is the same request (timeout, wrappers)

# Config keys a resumed run may change: length, save cadence, timeouts, logging, placement.
SAFE_TO_CHANGE = ("trainer.steps", "trainer.save_every", "trainer.keep_last", "trainer.timeout_s",
                  "trainer.weight_sync_timeout_s", "engine.timeout_s", "engine.max_restarts",
                  "agent.timeout_s", "agent.max_failure_rate", "check.consistency_every",
                  "check.canary_every", "ray.address", "ray.num_cpus", "ray.embedded", "name",
                  "out_dir", "metrics.")


class CheckpointError(RunDirError):
    """A checkpoint cannot be written or read."""


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = np_state["state"]["key"].tolist()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np_state = dict(state["numpy"])
    np_state["state"] = {**np_state["state"],
                         "key": np.array(np_state["state"]["key"], dtype=np.uint32)}
    np.random.set_state(np_state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _step_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    dirs = [p for p in root.glob("step_*") if p.name[5:].isdigit()] if root.is_dir() else []
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def latest(run_dir: Path) -> Path | None:
    return next(reversed(_step_dirs(Path(run_dir))), None)


def resolve(path: str | Path) -> Path:
    """A checkpoint dir, or a run dir (its latest checkpoint)."""
    p = Path(path)
    if (p / "driver.pt").is_file():
        return p
    if (found := latest(p) if p.is_dir() else None) is None:
        raise CheckpointError(f"'{path}' is neither a checkpoint (no driver.pt) nor a run "
                              "directory with one under checkpoints/ (runs save every "
                              "trainer.save_every steps and at the end)")
    return found


def check_resume_config(saved: dict, cfg: Config) -> None:
    """Raise ConfigError naming every changed key outside `SAFE_TO_CHANGE`."""
    def flat(d: Any, pre: str = "") -> dict[str, Any]:
        if not isinstance(d, dict) or (pre and not d):
            return {pre.rstrip("."): d}
        return {k: v for key, val in d.items() for k, v in flat(val, f"{pre}{key}.").items()}
    old, new = flat({**saved.pop("plugins", {}), **saved}), flat(
        {**to_dict(cfg.plugins), **{k: v for k, v in to_dict(cfg).items() if k != "plugins"}})
    changed = sorted(k for k in old.keys() | new.keys()
                     if old.get(k) != new.get(k) and not k.startswith(SAFE_TO_CHANGE))
    if changed:
        raise ConfigError("--resume: the config differs from the run's in " + ", ".join(
            f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in changed) + ". A resumed run may "
            f"change only {', '.join(SAFE_TO_CHANGE)}; start a new run (optionally from an export "
            "of this one) to change the rest")


class Checkpointer:
    """Saves every `trainer.save_every` steps and at the end; restores a run from a checkpoint."""

    def __init__(self, cfg: Config, run_dir: Path | None, policy: Any, engines: list[Any],
                 generator: Any, scheme: Any, plugins: Any) -> None:
        self.cfg, self.run_dir, self.policy, self.engines = cfg, run_dir, policy, engines
        self.generator, self.scheme, self.plugins = generator, scheme, plugins
        self.version = 0
        self.flush = lambda: None      # the trajectory writer's: on disk before the checkpoint
        self.stop_signal: int | None = None
        self._handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """First SIGINT/SIGTERM: finish the step, checkpoint, stop. One within `REPEAT_S` is a
        duplicate (timeout signals the run and its process group; wrappers forward it); a later
        one abandons the step."""
        if self.stop_signal is not None:
            if time.monotonic() - self._stop_at > REPEAT_S:
                raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: step abandoned")
            return
        self.stop_signal, self._stop_at = signum, time.monotonic()
        log.warning("stopping", signal=signal.Signals(signum).name, plan="finish this step, "
                    f"save a checkpoint, stop (again after {REPEAT_S:g} s: abandon the step)")

    def close(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers = {}

    def restore(self, path: Path | None) -> tuple[int, int]:
        """Load `path` (a checkpoint dir) if given; returns (first step to run, weight version:
        the caller pushes it to the engines)."""
        if path is None:
            return 0, 0
        path = resolve(path)
        state = torch.load(path / "driver.pt", weights_only=True)
        self.policy.load_checkpoint(str(path), state["critic"])
        self.policy.nonfinite_steps = state.get("nonfinite_steps", 0)
        self.version = state["version"]
        for e, rng in zip(self.engines, state["engine_rng"]):
            if rng is not None and hasattr(e, "set_rng_state"):
                actors.get(e.set_rng_state.remote(rng), timeout=self.cfg.engine.timeout_s)
        gen = state["generator"]
        gen["buffer"] = [[Trajectory(**{**t, "images": [ImageInput(**im) for im in t["images"]]})
                          for t in g] for g in gen["buffer"]]
        self.generator.load_state_dict(gen)
        if hasattr(self.scheme, "version"):
            self.scheme.version = self.version
        saved = state["plugins"]
        for impl in self.plugins.hook.molt_load_state_dict.get_hookimpls():
            if impl.plugin_name in saved:
                impl.function(state=saved[impl.plugin_name])
        if self.run_dir and (metrics := self.run_dir / "metrics.jsonl").exists():
            with metrics.open("r+b") as f:
                f.truncate(state["metrics_bytes"])     # rows past the checkpoint are redone
        set_rng_state(state["rng"])
        return state["step"], self.version

    def step_end(self, step: int, version: int) -> bool:
        """After step `step` was logged: save when due (every `save_every`, the last step, or on
        SIGINT/SIGTERM); True when the run must stop (a signal)."""
        self.version = version
        every, last = self.cfg.trainer.save_every, step + 1 == self.cfg.trainer.steps
        due = last or self.stop_signal is not None or (every and (step + 1) % every == 0)
        if self.run_dir is None or not due:
            return self.stop_signal is not None
        path = self.save(step + 1)
        if last:
            export(path, self.run_dir / "final")
        if self.stop_signal is not None:
            log.warning("stopped", step=step, checkpoint=str(path),
                        resume=f"molt run --resume {self.run_dir}")
        return self.stop_signal is not None

    def _engine_rng(self, i: int, late: list[str]) -> Any:
        """Engine `i`'s sampling RNG; None if it has none, died (the next step's requests replace
        it) or does not answer within `engine.timeout_s` or before a stop signal (it goes into
        `late`): awaited in 1 s slices, so SIGINT/SIGTERM are seen (they were not for 150 s)."""
        from ray.exceptions import RayActorError
        engine = self.engines[i]
        if not hasattr(engine, "rng_state"):
            return None
        ref, deadline = engine.rng_state.remote(), time.monotonic() + self.cfg.engine.timeout_s
        while not actors.wait([ref], timeout=1.0)[0]:
            if self.stop_signal is not None or time.monotonic() > deadline:
                late.append(f"engine {i} ({engine})")
                log.warning("engine does not answer: the checkpoint has not its RNG", engine=i)
                return None
        try:
            return actors.get(ref)
        except RayActorError as e:
            log.warning("engine died: the checkpoint has not its RNG", error=type(e).__name__)
            return None

    def save(self, done: int) -> Path:
        root = self.run_dir / "checkpoints"
        final, tmp = root / f"step_{done:06d}", root / f".tmp-step_{done:06d}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self.flush()
            critic = self.policy.save_checkpoint(str(tmp))
            metrics = self.run_dir / "metrics.jsonl"
            gen = self.generator.state_dict()
            gen["buffer"] = [[{**vars(t), "images": [dict(vars(im)) for im in t.images]}
                              for t in g] for g in gen["buffer"]]   # plain data: weights_only
            plugin_state = {impl.plugin_name: v for impl in
                            self.plugins.hook.molt_state_dict.get_hookimpls()
                            if (v := impl.function()) is not None}
            bad = {k: why for k, v in plugin_state.items() if (why := _unloadable(v))}
            late: list[str] = []
            engine_rng = [self._engine_rng(i, late) for i in range(len(self.engines))]
            buf = io.BytesIO()          # a full disk: an OSError, where torch.save's is not
            torch.save({"step": done, "version": self.version, "critic": critic,
                        "rng": rng_state(), "engine_rng": engine_rng, "generator": gen,
                        "plugins": {k: v for k, v in plugin_state.items() if k not in bad},
                        "metrics_bytes": metrics.stat().st_size if metrics.exists() else 0,
                        "nonfinite_steps": getattr(self.policy, "nonfinite_steps", 0)}, buf)
            (tmp / "driver.pt").write_bytes(buf.getbuffer())
            meta = {"step": done, "version": self.version, "model_path": self.cfg.model.path,
                    "dtype": self.cfg.model.dtype, "config": to_dict(self.cfg)}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
            if final.exists():                 # the same step saved again (a rerun of it)
                shutil.rmtree(final)
            os.rename(tmp, final)
        except (OSError, CheckpointException) as e:    # DCP's: the ranks' errors inside
            shutil.rmtree(tmp, ignore_errors=True)
            e = getattr(e, "cause", e)                  # a Ray actor's: the rank's own
            why = next((f"{type(x).__name__}: {x}" for x, _ in getattr(e, "failures", {}).values()),
                       f"{type(e).__name__}: {e}")
            prev, free = latest(self.run_dir), shutil.disk_usage(self.run_dir).free
            took = sum(f.stat().st_size for f in prev.rglob("*") if f.is_file()) if prev else 0
            raise CheckpointError(
                f"could not write checkpoint {final}: {why} ({free} bytes free there; the last "
                f"checkpoint took {took}). It was removed; the last complete checkpoint is "
                f"{prev or '(none)'}. Free disk space or make {self.run_dir} "
                f"writable, {resume_hint(self.run_dir)}") from e
        for old in _step_dirs(self.run_dir)[:-max(self.cfg.trainer.keep_last, 1)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if late and self.stop_signal is None:      # saved: now the run stops
            raise CheckpointError(
                f"{late[0]} did not answer within {self.cfg.engine.timeout_s}s (engine.timeout_s) "
                f"while {final} was written: it holds the run but not that engine's sampling RNG "
                f"(a resume samples anew there). See the engine's log for why it hangs, "
                f"{resume_hint(self.run_dir)}")
        for name, why in bad.items():      # after the weights are safe: the run stops here
            raise CheckpointError(
                f"plugin {name}'s molt_state_dict returned what a checkpoint cannot hold ({why}); "
                f"{final} holds the weights and the rest of the run, not that state (molt export "
                f"{final} OUT). Return plain data from it: tensors, numbers, text, lists, dicts")
        return final


def _unloadable(value: Any) -> str | None:
    """Why `value` would not load back as `restore` loads a checkpoint (weights_only), or None."""
    try:
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:          # pickling and the weights_only unpickler raise many kinds
        return f"{type(e).__name__}: {str(e)[:160]}"
    return None


def _policy_tensors(policy_dir: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) policy weights of a DCP checkpoint, by HF name, read in one process."""
    reader = dcp.FileSystemReader(str(policy_dir))
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in reader.read_metadata().state_dict_metadata.items()
             if k.startswith("model.policy.")}
    with warnings.catch_warnings():      # "no process group: loading in one process" is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {k.removeprefix("model.policy."): v for k, v in state.items()}


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """`molt export CHECKPOINT OUT`: a checkpoint (or a run dir: its latest) as an HF directory."""
    ckpt = resolve(checkpoint)
    meta = json.loads((ckpt / "meta.json").read_text())
    if not (Path(meta["model_path"]) / "config.json").is_file():
        raise CheckpointError(f"the run's model.path {meta['model_path']} (config, tokenizer) is "
                              "gone; export needs it next to the checkpoint's weights")
    state = _policy_tensors(ckpt / "policy")
    lora_cfg = meta["config"]["trainer"].get("lora") or {}
    if lora_cfg.get("rank"):                  # adapters merged: W + alpha/rank * B @ A
        from molt_core.lora import merged
        state = dict(merged(iter(state.items()), lora_cfg["alpha"] / lora_cfg["rank"]))
    return export_hf(state, meta["model_path"], out, meta["dtype"])


def init_from(cfg: Config) -> None:
    """Resolve `model.init_from` (a run dir or checkpoint) in place: model.path its weights as an
    HF directory (the run's final/ when that checkpoint is its last step, else one exported into
    the checkpoint), model.init_from the checkpoint; carry: trainer.lora must be its adapters'."""
    m = cfg.model
    if not Path(m.init_from).is_dir():
        raise ConfigError(f"model.init_from '{m.init_from}' does not exist: name the run directory "
                          "of a molt sft or molt run (its final/ or latest checkpoint is used)")
    try:
        ckpt = resolve(m.init_from)
        meta = json.loads((ckpt / "meta.json").read_text())
        final = ckpt.parents[1] / "final"
        hf = final if final.is_dir() and meta["step"] == meta["config"]["trainer"]["steps"] \
            else ckpt / "hf"
        if not hf.is_dir():
            export(ckpt, hf)
    except CheckpointError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    theirs = {k: meta["config"]["trainer"]["lora"][k] for k in ("rank", "alpha", "target_modules")}
    mine = {k: getattr(cfg.trainer.lora, k) for k in theirs}
    if m.init_lora == "carry" and (not theirs["rank"] or theirs != mine):
        raise ConfigError(f"model.init_lora=carry: {ckpt}'s adapters are {theirs} (rank 0: none), "
                          f"this run's trainer.lora {mine}: make them equal, or set "
                          "model.init_lora=merge to train on its merged weights")
    if m.init_lora == "carry" and cfg.trainer.lora.sync == "adapter":
        raise ConfigError("model.init_lora=carry serves the engines merged weights (final/): "
                          "adapters pushed over them would count twice; trainer.lora.sync=merged")
    m.path, m.init_from = str(hf), str(ckpt)


def export_hf(state_dict: dict[str, torch.Tensor], model_dir: str | Path, out: str | Path,
              dtype: str | None = None) -> Path:
    """Write `state_dict` ({HF name: tensor}: `model_dir`'s model, trained) as a plain HF directory
    at `out`: safetensors + config from the model class, plus every non-weight file of `model_dir`
    (tokenizer, configs). Floating tensors are cast to `dtype` (default: as stored); atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from molt_core.multimodal import is_vl

    model_dir, out = Path(model_dir), Path(out)
    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if is_vl(config) else AutoModelForCausalLM
    if dtype is not None:
        state_dict = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                      for k, v in state_dict.items()}
    with torch.device("meta"):
        model = auto.from_config(config, dtype=getattr(torch, dtype or "float32"))
    unexpected = model.load_state_dict(state_dict, strict=False, assign=True).unexpected_keys
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint weights do not fit {model_dir}: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    weights = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(weights):
            shutil.copy2(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def _run_config(run_dir: str | Path) -> dict:
    if not (path := Path(run_dir) / "config.yaml").is_file():
        raise CheckpointError(f"--resume {run_dir}: not a run directory (no config.yaml)")
    return yaml.safe_load(path.read_text())


def resume_recipe(run_dir: str | Path, recipe: str | None, overrides: list[str]
                  ) -> tuple[str, list[str]]:
    """`molt run --resume RUN_DIR [RECIPE] [k=v ...]`: the recipe defaults to the run's config
    (plugin sections back at top level, as a recipe has them)."""
    if recipe is not None and "=" in recipe and not Path(recipe).is_file():
        recipe, overrides = None, [recipe, *overrides]
    if recipe is None:
        data = _run_config(run_dir)
        data.update(data.pop("plugins", None) or {})
        fd, recipe = tempfile.mkstemp(prefix="molt-resume-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(data, f, sort_keys=False)
    return recipe, overrides


def prepare_resume(run_dir: str | Path, checkpoint: str | None, cfg: Config, argv: list[str]
                   ) -> tuple[Path, Path]:
    """Check the config against the run's, pick the checkpoint, note the resume in the run dir."""
    run_dir = Path(run_dir)
    check_resume_config(_run_config(run_dir), cfg)
    ckpt = resolve(checkpoint or run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    meta_path = run_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta.setdefault("resumed", []).append({"argv": argv, "checkpoint": str(ckpt)})
    meta_path.write_text(json.dumps(meta, indent=2))
    return run_dir, ckpt
