"""Engine restarts and verified syncs (docs/scaling.md, "Weight sync"): a dead engine actor is
replaced and loaded with the trainer's weights; `EngineRestarts` is the scheme's weight pusher
(`contracts.WeightPusher`), so a push that meets a dead engine is redone under the scheme's
conditions."""

from __future__ import annotations

from typing import Any

import ray
import structlog

from molt_core.config import Config
from molt_core.run import actors
from molt_core.run.cluster import spawn_engine
from molt_core.trajectory import Trajectory

__all__ = ["EngineDiedError", "EngineRestarts"]

log = structlog.get_logger("molt.cluster")
CANARY = "the quick brown fox jumps over the lazy dog; 1 + 2 = 3."


class EngineDiedError(RuntimeError):
    """An engine actor died and `engine.max_restarts` replacements are used up."""


class EngineRestarts:
    """Pushes the trainer's weights and replaces dead engine actors (same options),
    `engine.max_restarts` times per run (`faults/engine_restarts`): while the driver waits for
    rollouts (loaded with the version last pushed), and when a push meets one."""

    def __init__(self, cfg: Config, plugins: Any, generator: Any, policy: Any) -> None:
        self.cfg, self.plugins, self.gen, self.policy = cfg, plugins, generator, policy
        self.engines = generator.client.engines        # the run's list: replaced in place
        self.version = 0                               # on the engines
        generator.on_engine_death(lambda dead: self.revive(dead, self.version))
        generator.counters.setdefault("faults/engine_restarts", 0)
        generator.counters.setdefault("faults/weight_sync_mismatches", 0)
        self.sent: dict[str, int] = {}          # the last push's checksums, by parameter
        self.tol = self._calibrate()            # the canary's

    def push(self, version: int) -> Any:
        """To every engine; a checksum mismatch is pushed once more. Rank 0's stats."""
        from molt_core.weight_sync import WeightMismatchError, WeightSyncError   # imports torch
        self.version = version
        try:
            return self._push(version)
        except WeightMismatchError as e:
            log.warning("weight_sync_mismatch", error=str(e), version=version)
            self.gen.counters["faults/weight_sync_mismatches"] += 1
            return self._push(version)
        except (WeightSyncError, ray.exceptions.RayActorError):
            dead = dict(self.gen.client.dead)
            for i, e in enumerate(self.engines):
                try:
                    actors.get(e.get_version.remote(), timeout=self.cfg.engine.timeout_s)
                except ray.exceptions.RayActorError as err:
                    dead[i] = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            if not dead:
                raise
        self.revive(dead, version, push_all=True)

    def revive(self, dead: dict[int, str], version: int, push_all: bool = False) -> None:
        """Replace engines `dead` ({index: cause}), push them (`push_all`: all) the weights."""
        for i, cause in sorted(dead.items()):
            n = self.gen.counters["faults/engine_restarts"]
            if n >= self.cfg.engine.max_restarts:
                raise EngineDiedError(
                    f"engine {i} ({self.engines[i]}) died: {cause}; engine.max_restarts={n} "
                    "replacements are used up: raise it (a resumed run may) or see the engine's "
                    "log for why it dies")
            self.gen.counters["faults/engine_restarts"] = n + 1
            log.warning("engine_restart", engine=i, cause=cause, restarts=n + 1)
            self.engines[i] = spawn_engine(self.cfg, self.plugins, i, f"-r{n + 1}",
                                           actors.is_local(self.engines))
        actors.get([self.engines[i].get_version.remote() for i in dead],    # loaded: as at start
                timeout=self.cfg.engine.timeout_s)
        self.policy.push_weights(self.engines if push_all else [self.engines[i] for i in dead],
                                 version)
        for i in dead:
            self.gen.client.dead.pop(i, None)
        self.gen.release_requests()

    def _push(self, version: int) -> Any:
        stats = self.policy.push_weights(self.engines, version)
        self.sent.update((stats or {}).get("checksums", {}))
        return stats

    def _calibrate(self) -> float:
        """`consistency_tol`; in bf16/fp16 with its default, 4x the gap of the engines' load of
        the checkpoint to the trainer's (the same weights, before any step: numerics only), in
        [1e-3, 1.0]: bf16 SmolLM2's 0.2-0.5 passes, a changed tensor of a model whose log-probs
        move less than that (a tiny one: 0.2 against 0.002) still fails."""
        from molt_core.consistency import consistency_tol
        tol = consistency_tol(self.cfg)
        if tol < 1.0 or self.cfg.check.consistency_tol or not self.cfg.check.canary_every:
            return tol
        return min(max(4 * float(self._canary_gaps(0).max()), 1e-3), 1.0)

    def _canary_gaps(self, version: int) -> Any:
        """[engines with `score`] max |engine - trainer| log-prob on `CANARY` (`logprob_gaps`)."""
        from molt_core.consistency import logprob_gaps
        from molt_core.weight_sync import _wait
        ids = list(self.gen.tokenizer(CANARY, add_special_tokens=False)["input_ids"])
        engines = [e for e in self.engines if hasattr(e, "score")]
        scores = _wait([e.score.remote(ids) for e in engines], engines,
                       self.cfg.engine.timeout_s, "score (weight-sync canary)")
        return logprob_gaps(self.policy, [Trajectory(
            token_ids=ids, loss_mask=[False] + [True] * len(s), logprobs=[0.0] + s,
            versions=[-1] + [version] * len(s)) for s in scores], version, 1.0)

    def check_canary(self, version: int) -> None:
        """Every `check.canary_every` syncs from the first (a layout bug shows at once): engines'
        `CANARY` log-probs match the trainer's on `version`, within `consistency_tol`."""
        from molt_core.weight_sync import WeightMismatchError
        every, tol = self.cfg.check.canary_every, self.tol
        if not every or (version - 1) % every:
            return
        engines = [e for e in self.engines if hasattr(e, "score")]
        for attempt in (0, 1):
            gaps = self._canary_gaps(version)
            self.gen.counters["check/canary_max_abs"] = float(gaps.max())
            if not (bad := [i for i, g in enumerate(gaps.tolist()) if not g <= tol]):  # NaN fails
                return
            if attempt == 0:
                log.warning("weight_sync_canary_mismatch", engines=bad, gap=float(gaps.max()))
                self.gen.counters["faults/weight_sync_mismatches"] += 1
                self.push(version)
        i = bad[0]
        where = "its bucket checksums matched the trainer's: the bytes arrived intact"
        if hasattr(engines[i], "weight_checksums"):
            now = actors.get(engines[i].weight_checksums.remote(),
                             timeout=self.cfg.engine.timeout_s)
            changed = [n for n, c in now.items() if self.sent.get(n, c) != c]
            where = (f"its parameter '{changed[0]}' (and {len(changed) - 1} more) no longer "
                     "holds the bytes trainer rank 0 sent" if changed else where)
        raise WeightMismatchError(
            f"weight sync of version {version}: engine {i} ({engines[i]}) scores the canary text "
            f"up to {gaps[i]:.3g} away from the trainer's log-probs (tolerance {tol:.3g}),"
            f" after a second push too; {where}. Likely causes: the engine's load or re-pack of "
            "the weights (fused or MoE layouts, a partial load), a dtype or model config "
            "difference between the two loads")
