"""Trainer backend `tinker`: the `fsdp2` Policy whose ranks take Tinker's per-step Adam
hyper-parameters (`AdamParams` of each `optim_step`), can drop their optimizer state (`load_weights`
without it), and give and take a model's whole trainable state (`get_state` / `set_state`: LoRA
weights, AdamW moments, lr schedule), so several training clients time-share one policy. The
core's `TrainStep` carries no optimizer settings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from molt_core import lora
from molt_core.policy.handle import Policy
from molt_core.policy.worker import PolicyWorker, param_groups

__all__ = ["TinkerPolicy", "TinkerWorker"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t      # this rank's shard (a view)


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

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    @torch.no_grad()
    def get_state(self) -> dict[str, Any]:
        """CPU copies of this rank's shards of the trainable weights and their AdamW state (in
        `optim.param_groups` order), and the lr schedule's state."""
        def cpu(t: Any) -> Any:
            return (_local(t).to("cpu", copy=True), str(_local(t).device), isinstance(t, DTensor)
                    ) if torch.is_tensor(t) else t
        params = self._trainable()
        return {"params": [_local(p).to("cpu", copy=True) for p in params],
                "optim": [{k: cpu(v) for k, v in self.optim.state[p].items()}
                          if p in self.optim.state else None for p in params],
                "schedule": self.schedule.state_dict()}

    @torch.no_grad()
    def set_state(self, state: dict[str, Any]) -> None:
        """What `get_state` gave, back in place (copied: `state` stays as it was)."""
        def back(v: Any, p: torch.Tensor) -> Any:
            if not isinstance(v, tuple):
                return v
            t, device, dtensor = v
            t = t.to(device, copy=True)     # AdamW's moments follow a DTensor param's layout
            return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride()) if dtensor else t
        params = self._trainable()
        self.optim.state.clear()
        for p, w, s in zip(params, state["params"], state["optim"], strict=True):
            _local(p).copy_(w)
            if s is not None:
                self.optim.state[p] = {k: back(v, p) for k, v in s.items()}
        self.schedule.load_state_dict(state["schedule"])
        lora.drop_merged(self.model)        # a merged weight kept from the old adapters


class TinkerPolicy(Policy):
    worker_cls = TinkerWorker

    def set_adam(self, **adam: float) -> None:
        self._get([w.set_adam.remote(**adam) for w in self.workers], "set_adam")

    def reset_optimizer(self) -> None:
        self._get([w.reset_optimizer.remote() for w in self.workers], "reset_optimizer")

    def get_state(self) -> dict[str, Any]:
        """The trained state of every rank (CPU copies) and the non-finite step counts."""
        return {"ranks": self._get([w.get_state.remote() for w in self.workers], "get_state"),
                "nonfinite": (self.nonfinite_steps, self._nonfinite_run)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._get([w.set_state.remote(s) for w, s in zip(self.workers, state["ranks"],
                                                         strict=True)], "set_state")
        self.nonfinite_steps, self._nonfinite_run = state["nonfinite"]
