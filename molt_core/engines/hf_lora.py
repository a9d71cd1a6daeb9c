"""The hf engine's LoRA adapters (`trainer.lora.sync: adapter`), applied unmerged per row; a row
pins its adapter's newest version at its start and, with `keep_versions`, ends on it across pushes
(docs/scaling.md, "LoRA adapters"); live versions <= `max_adapters`, the oldest evicted."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from molt_core import weight_sync

POLICY = "policy"          # the adapter the run's own pushes load
BASE: dict = {}            # a row's pin to the base model (no adapter)


class Adapters:
    def __init__(self, model: torch.nn.Module, device: torch.device, max_adapters: int,
                 keep_versions: bool) -> None:
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.device, self.max, self.keep = device, max_adapters, keep_versions
        self.latest: dict[str, dict] = {}      # adapter id -> its newest version
        self.kept: list[dict] = []              # older versions rows still decode on
        self.staged: dict[str, dict[str, torch.Tensor]] = {}
        self.groups: list[tuple[dict, torch.Tensor | None]] = []
        self.evictions = self.peak = 0

    def stage(self, lora: list[tuple[str, torch.Tensor]], version: int) -> dict[str, int]:
        """Check LoRA tensors against the base and keep copies until `install`; their sums."""
        for name, t in lora:
            aid, mod, part = lora_name(name)
            lin = self.linears.get(mod)
            fits = t.is_floating_point() and (t.numel() == 1 if part == "s" else lin is not None
                                               and t.ndim == 2 and t.shape[part == "A"] == (
                                                   lin.out_features, lin.in_features)[part == "A"])
            if not fits:
                self.staged.pop(aid, None)
                raise ValueError(f"adapter {aid!r} (version {version}): '{name}' {list(t.shape)} "
                                 f"does not fit this engine's base model: "
                                 f"{'no Linear ' + repr(mod) if lin is None else lin}; was the "
                                 "adapter trained on another base model (model.path)?")
        for name, t in lora:
            self.staged.setdefault(lora_name(name)[0], {})[name] = t.clone()
        return dict(zip([n for n, _ in lora], weight_sync.checksums(
            [(n, self.staged[lora_name(n)[0]][n]) for n, _ in lora])))

    def install(self, aid: str, version: int, pins: list[dict]) -> bool:
        """The staged `aid` becomes its newest version; True: a version `pins` (the rows
        decoding now) use was evicted."""
        got = self.staged.pop(aid)
        parts = {lora_name(n)[1:]: t for n, t in got.items()}      # (module, A|B|s) -> tensor
        mods = sorted({m for m, k in parts if k != "s"})
        bad = [m for m in mods if (m, "A") not in parts or (m, "B") not in parts
               or parts[m, "A"].shape[0] != parts[m, "B"].shape[1]]
        if problem := ("no lora_scaling" if ("", "s") not in parts else
                       f"'{bad[0]}' lacks lora_A or lora_B, or their ranks differ" if bad else
                       f"this engine holds {self.max} adapters already (engine.args."
                       "max_adapters): raise it" if aid not in self.latest
                       and len(self.latest) >= self.max else ""):
            raise ValueError(f"adapter {aid!r} (version {version}): {problem}")
        for m in mods:
            if "molt_adapted" not in (lin := self.linears[m]).__dict__:
                lin.molt_adapted, lin.forward = True, partial(self.adapted, m, lin.forward)
        old = self.latest.get(aid)
        self.latest[aid] = {"named": got, "s": float(parts["", "s"]), "version": version,
                            "mods": {m: (parts[m, "A"], parts[m, "B"]) for m in mods}}
        used = {id(p) for p in pins}
        self.kept = sorted([e for e in self.kept + ([old] if old and self.keep else [])
                            if id(e) in used], key=lambda e: e["version"])
        n = max(0, len(self.latest) + len(self.kept) - self.max)
        del self.kept[:n]
        self.evictions += n
        self.peak = max(self.peak, len(self.latest) + len(self.kept))
        return n > 0

    def live(self, pin: dict) -> bool:
        return pin is BASE or any(pin is e for e in (*self.latest.values(), *self.kept))

    def resolve(self, adapter: str | None) -> dict:
        """A request's adapter (None: the policy's if loaded, else the base) -> its newest."""
        return BASE if adapter == "base" else self.latest.get(adapter or POLICY, BASE)

    def group(self, pins: list[dict]) -> list[tuple[dict, torch.Tensor | None]]:
        """(adapter version, its rows; None: all) of a batch, the base's rows left out."""
        uniq = list({id(p): p for p in pins}.values())
        return [(p, None if len(uniq) == 1 else torch.tensor(
            [i for i, q in enumerate(pins) if q is p], device=self.device))
            for p in uniq if p is not BASE]

    def adapted(self, mod: str, base: Any, x: torch.Tensor) -> torch.Tensor:
        """x W^T + s (x A^T) B^T for the rows of each adapter of this forward (`groups`), as
        PEFT's forward computes it (in A's dtype, the trainer's fp32 masters)."""
        y = base(x)
        for ad, rows in self.groups:
            if (ab := ad["mods"].get(mod)) is not None:
                xs = x if rows is None else x[rows]
                d = torch.nn.functional.linear(torch.nn.functional.linear(
                    xs.to(ab[0].dtype), ab[0]), ab[1]) * ad["s"]
                y = ((y + d).to(y.dtype) if rows is None else
                     y.index_copy(0, rows, (y[rows] + d).to(y.dtype)))
        return y

    def stats(self, pins: list[dict]) -> dict:
        used = {id(p) for p in pins}
        return {"adapters": {a: ad["version"] for a, ad in self.latest.items()},
                "live_versions": len(self.latest) + sum(id(e) in used for e in self.kept),
                "live_versions_peak": self.peak, "adapter_evictions": self.evictions}


def lora_name(name: str) -> tuple[str, str, str] | None:
    """A LoRA tensor's wire name, `[ID/]MODULE.lora_A.weight` (A [r, in]), `.lora_B.weight`
    (B [out, r]) or `[ID/]lora_scaling` (s), as (ID, default POLICY; MODULE or ""; A|B|s); a
    base weight's: None."""
    aid, _, rest = name.rpartition("/")
    if rest == "lora_scaling":
        return aid or POLICY, "", "s"
    for k in "AB":
        if rest.endswith(f".lora_{k}.weight"):
            return aid or POLICY, rest[:-14], k
    return None
