"""Test plugin (`--plugin corrupt_plugin`): engine `hf_corrupt`, the real HFEngine perturbing one
parameter (x1.5) in weight updates to version >= `from_version` (`engine.args`), `times` of them:
`where="bytes"` in the bucket it received (its checksums see it), `where="load"` after the load
(only the canary can)."""

from __future__ import annotations

import sys

import ray

from molt_core import hookimpl
from molt_core.engines.hf import HFEngine

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARAM = "model.norm.weight"


class CorruptEngine(HFEngine):
    def __init__(self, path: str, *, where: str = "bytes", from_version: int = 2,
                 times: int = 100, **kw) -> None:
        super().__init__(path, **kw)
        self.where, self.from_version, self.times = where, from_version, times

    def _due(self, version: int, where: str) -> bool:
        due = where == self.where and version >= self.from_version and self.times > 0
        self.times -= due
        return due

    async def update_weights(self, named_tensors, version):
        if any(n == PARAM for n, _ in named_tensors) and self._due(version, "bytes"):
            named_tensors = [(n, t * 1.5 if n == PARAM else t) for n, t in named_tensors]
        await super().update_weights(named_tensors, version)

    async def finish_weight_update(self, version):
        if self._update_version == version and self._due(version, "load"):
            self._params[PARAM].data.mul_(1.5)
        return await super().finish_weight_update(version)


@hookimpl
def molt_engines():
    return {"hf_corrupt": CorruptEngine}
