"""Trainer backend `automodel` (GPU): `fsdp2`'s ranks, loss, log-probs and weight sync, with the
model built and parallelized by NVIDIA NeMo AutoModel (docs/scaling.md, "Multi-GPU training")."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from molt_core import moe
from molt_core.policy.handle import Policy
from molt_core.policy.worker import PolicyWorker, gathered

__all__ = ["AUTOMODEL_MISSING", "AutoModelPolicy", "AutoModelWorker", "automodel_missing"]

AUTOMODEL_MISSING = ("trainer.backend=automodel needs NVIDIA NeMo AutoModel and a CUDA GPU per "
                     "trainer rank: pip install nemo-automodel==0.7.0 (its import needs "
                     "triton==3.8.0) on a GPU machine; on CPU use trainer.backend=fsdp2")


def automodel_missing() -> bool:
    # find_spec, not import: importing nemo_automodel costs seconds and needs triton.
    return importlib.util.find_spec("nemo_automodel") is None


class AutoModelWorker(PolicyWorker):
    """One rank of the `automodel` backend: `PolicyWorker` with AutoModel's model construction."""

    def _build_model(self, model_path: str, dtype: torch.dtype) -> torch.nn.Module:
        if not torch.cuda.is_available():
            raise RuntimeError(f"{AUTOMODEL_MISSING} (this rank sees no CUDA device)")
        try:
            from nemo_automodel import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText
            from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config
            from nemo_automodel.components.distributed.mesh import ParallelismSizes
        except Exception as e:  # ImportError, or a broken install (triton version)
            raise RuntimeError(f"{AUTOMODEL_MISSING} (import failed: {e!r})") from None
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
        from transformers import AutoConfig

        t = self.cfg
        sizes = ParallelismSizes(dp_size=t["dp_size"] or None, tp_size=t["tp_size"],
                                 cp_size=t["cp_size"], ep_size=t["ep_size"])
        strategy = FSDP2Config(
            mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
            offload_policy=CPUOffloadPolicy() if t["optimizer_offload"] else None)
        setup = DistributedSetup.build(strategy, sizes, world_size=self.world_size,
                                       timeout_minutes=max(1, int(t["timeout_s"] // 60)))
        vision = hasattr(AutoConfig.from_pretrained(model_path), "vision_config")
        cls = NeMoAutoModelForImageTextToText if vision else NeMoAutoModelForCausalLM
        custom = t["ep_size"] > 1      # EP lives in AutoModel's MoE layers, not in HF's
        model = cls.from_pretrained(model_path, distributed_setup=setup, dtype=torch.float32,
                                    force_hf=not custom, attn_implementation="sdpa",
                                    use_liger_kernel=False)
        # Grads are averaged over the data (and context) parallel ranks; tensor-parallel peers
        # hold the same rows and shards of one gradient.
        self.grad_scale = self.world_size // t["tp_size"]
        for gate in moe.moe_gates(model):    # HF MoE layers (ep 1); AutoModel's own have none
            gate.requires_grad_(t["moe_routing"] != "freeze_router")
        self._mesh = setup.mesh_context
        self._adapter = getattr(model, "state_dict_adapter", None) if custom else None
        if hasattr(model, "set_reduce_scatter_unused_params"):   # as in PolicyWorker
            model.set_reduce_scatter_unused_params(True)
        _plain_outputs(model, custom)
        return model

    def _clip_grads(self) -> float:
        """AutoModel's step boundary: reduce tensor-parallel replica grads, divide expert grads by
        the FSDP/EP ratio (experts see every EP rank's tokens), clip with EP-aware norms."""
        from nemo_automodel.components.distributed.tp_replicas import (
            synchronize_tp_replica_gradients)
        from nemo_automodel.components.training.utils import (
            get_expert_tp_replication_factor, scale_grads_and_clip_grad_norm)

        parts, mesh, moe_mesh = [self.model], self._mesh.device_mesh, self._mesh.moe_mesh
        synchronize_tp_replica_gradients(parts, mesh)
        ep_axis = "ep" if moe_mesh is not None and "ep" in moe_mesh.mesh_dim_names else None
        norm = scale_grads_and_clip_grad_norm(
            self.cfg["grad_clip"], parts, device_mesh=mesh, moe_mesh=moe_mesh,
            ep_axis_name=ep_axis, dp_group_size=self.grad_scale,
            expert_tp_replication_factor=get_expert_tp_replication_factor(parts, mesh))
        return float(gathered(torch.as_tensor(norm)))

    def _named_full_tensors(self, merge: bool = True, master: bool = False
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under HF names (AutoModel's MoE layers stack experts differently)."""
        for name, t in super()._named_full_tensors(merge, master):
            if self._adapter is None:
                yield name, t
            else:
                yield from self._adapter.convert_single_tensor_to_hf(name, t)


def _plain_outputs(model: torch.nn.Module, custom: bool) -> None:
    """`token_logprobs` expects HF's `model.model(...).last_hidden_state` and a plain `lm_head`
    output: tensor-parallel outputs (DTensors) are gathered; AutoModel's own models return the
    hidden tensor and take no `use_cache`."""
    def hidden(_m: Any, _args: Any, _kwargs: Any, out: Any) -> SimpleNamespace:
        h = out if isinstance(out, torch.Tensor) else out.last_hidden_state
        return SimpleNamespace(last_hidden_state=gathered(h))

    def drop_cache(_m: Any, args: Any, kwargs: dict) -> tuple[Any, dict]:
        kwargs.pop("use_cache", None)
        return args, kwargs

    if custom:
        model.model.register_forward_pre_hook(drop_cache, with_kwargs=True)
    model.model.register_forward_hook(hidden, with_kwargs=True)
    model.lm_head.register_forward_hook(lambda _m, _a, out: gathered(out))


class AutoModelPolicy(Policy):
    """Driver handle: `Policy` running `AutoModelWorker` ranks (one GPU each)."""

    worker_cls = AutoModelWorker

    def __init__(self, model_path: str, trainer_cfg: Any, **kwargs: Any) -> None:
        if automodel_missing():
            raise RuntimeError(AUTOMODEL_MISSING)
        super().__init__(model_path, trainer_cfg, **kwargs)

