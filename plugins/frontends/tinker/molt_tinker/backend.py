"""Trainer backend `tinker`: the `fsdp2` Policy whose ranks take Tinker's per-step Adam
hyper-parameters (`AdamParams` of each `optim_step`) and can drop their optimizer state
(`load_weights` without it). The core's `TrainStep` carries no optimizer settings."""

from __future__ import annotations

import math

from molt_core.policy.handle import Policy
from molt_core.policy.worker import PolicyWorker, param_groups

__all__ = ["TinkerPolicy", "TinkerWorker"]


class TinkerWorker(PolicyWorker):
    def set_adam(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 grad_clip_norm: float) -> None:
        """AdamW's settings for the next steps (biases and norms keep no decay, as `param_groups`
        splits them); grad_clip_norm 0: no clipping, as in Tinker."""
        decays = {id(p) for g in param_groups(self.model, 1.0) if g["weight_decay"]
                  for p in g["params"]}
        for g in self.optim.param_groups:
            g.update(lr=lr, betas=(beta1, beta2), eps=eps,
                     weight_decay=weight_decay if id(g["params"][0]) in decays else 0.0)
        # the server runs a constant schedule: lr = base_lr from here on
        self.schedule.base_lrs = [lr] * len(self.optim.param_groups)
        self.cfg["grad_clip"] = grad_clip_norm if grad_clip_norm > 0 else math.inf

    def reset_optimizer(self) -> None:
        self.optim.state.clear()


class TinkerPolicy(Policy):
    worker_cls = TinkerWorker

    def set_adam(self, **adam: float) -> None:
        self._get([w.set_adam.remote(**adam) for w in self.workers], "set_adam")

    def reset_optimizer(self) -> None:
        self._get([w.reset_optimizer.remote() for w in self.workers], "reset_optimizer")
