"""Every shipped engine, trainer backend, rollout scheme, agent, env and metric sink satisfies its
Protocol in `molt_core.contracts` (names, parameters, async-ness), and the checker rejects
implementations that do not."""

from __future__ import annotations

import inspect
from collections import Counter
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from molt_core import contracts, weight_sync
from molt_core.config import Config
from molt_core.plugins import build_plugins


def check(impl: Any, proto: type) -> list[str]:
    """What keeps `impl` (a class, or an instance: its attributes too) from satisfying `proto`:
    a missing member, parameters that differ in name, kind or optionality (an extra parameter
    needs a default), a method async where the contract's is not or the reverse; [] if nothing.
    The constructor is compared where the contract declares one (engines, trainer backends)."""
    cls, problems = impl if isinstance(impl, type) else type(impl), []
    for name in [n for n in vars(proto) if not n.startswith("_")] + ["__init__"]:
        want, have = vars(proto).get(name), getattr(cls, name, None)
        if getattr(want, "__qualname__", "") != f"{proto.__name__}.{name}":
            continue                    # `__init__`: the contract says nothing of the constructor
        if have is None:
            problems.append(f"{name}: missing")
            continue
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(have):
            problems.append(f"{name}: must {'' if inspect.iscoroutinefunction(want) else 'not '}"
                            "be async")
        problems += [f"{name}{inspect.signature(have)}: {p}" for p in _differences(want, have)]
    problems += [f"{n}: missing attribute" for n in vars(proto).get("__annotations__", {})
                 if not isinstance(impl, type) and not hasattr(impl, n)]
    return problems


def _differences(want: Callable, have: Callable) -> list[str]:
    """How `have` cannot be called as `want` is (both with `self` first)."""
    w, h = (list(inspect.signature(f).parameters.values())[1:] for f in (want, have))
    kinds = {p.kind for p in h}
    pos = [p for p in h if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out, seen = [], {p.name for p in w}
    for i, p in enumerate(w):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            out += [] if p.kind in kinds else [f"takes no {p}"]
            continue
        if p.kind is p.KEYWORD_ONLY:
            q = next((q for q in h if q.name == p.name and q.kind in (q.KEYWORD_ONLY,
                                                                     q.POSITIONAL_OR_KEYWORD)),
                     None if p.VAR_KEYWORD not in kinds else p)
        else:
            q = pos[i] if i < len(pos) else None if p.VAR_POSITIONAL not in kinds else p
        seen.add(getattr(q, "name", ""))
        if q is None or q.name != p.name:
            out.append(f"needs {p.kind.description} parameter '{p.name}'"
                       + ("" if q is None else f" where it has '{q.name}'"))
        elif p.default is not p.empty and q.default is q.empty:
            out.append(f"parameter '{p.name}' needs a default (callers may leave it out)")
    out += [f"parameter '{q.name}' needs a default (callers never pass it)" for q in h
            if q.default is q.empty and q.name not in seen
            and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    return out


@pytest.fixture(scope="module")
def plugins():
    return build_plugins()


def _shipped(plugins, kind: str) -> list[tuple[str, Any]]:
    entries = [(name, plugins.get(kind, name)) for name in sorted(plugins.registry[kind])]
    assert entries, f"no {kind} registered"
    return [(name, e) for name, e in entries if e.__name__ != "VLLMUnavailable"]


def test_engines():
    from molt_core.engines.hf import HFEngine
    from molt_core.engines.vllm import VLLMEngine   # vllm itself is imported when one starts

    for cls in (HFEngine, VLLMEngine):
        assert check(cls, contracts.Engine) == [], cls
        assert check(cls, weight_sync.Receiver) == [], cls       # transports broadcast, shm


def test_registered_engines(plugins):
    for name, cls in _shipped(plugins, "engine"):
        assert check(cls, contracts.Engine) == [], name


def test_trainer_backends(plugins):
    from molt_core.policy.automodel import AutoModelPolicy
    from molt_core.policy.handle import Policy

    shipped = dict(_shipped(plugins, "trainer_backend"))
    assert {Policy, AutoModelPolicy} <= set(shipped.values())
    for name, cls in shipped.items():
        assert check(cls, contracts.TrainerBackend) == [], name


def test_rollout_schemes(plugins):
    """Each factory builds its scheme from stand-ins (no Ray, no engines): `version` is there."""
    generator = SimpleNamespace(start_pool=lambda n: None)
    for name, factory in _shipped(plugins, "rollout_scheme"):
        scheme = factory(Config(), generator, SimpleNamespace(), [])
        assert check(scheme, contracts.RolloutScheme) == [], name
        assert isinstance(scheme, contracts.RolloutScheme)
        if hasattr(scheme, "refill"):       # optional: what batch filters get as `refill`
            assert list(inspect.signature(scheme.refill).parameters) == ["n"], name


def test_the_run_generator():
    """The schemes' generator is `PooledGenerator`; the core `Generator` (eval, tools) has no pool."""
    from molt_core.rollout.generator import Generator
    from molt_core.rollout.pool import PooledGenerator

    assert check(PooledGenerator, contracts.RolloutGenerator) == []
    assert check(Generator, contracts.RolloutGenerator) == [
        f"{n}: missing" for n in ("start_pool", "take", "advance", "drain", "hold_requests",
                                  "release_requests")]


class _Only:
    """A stand-in with `proto`'s members alone: it records each call (`returns[name](*args)`
    answers it); any other attribute raises."""

    def __init__(self, proto: type, **returns: Callable) -> None:
        self._names = {n for n in vars(proto) if not n.startswith("_")} | set(
            vars(proto).get("__annotations__", {}))
        self.calls: list[tuple] = []
        self._returns = returns

    def __getattr__(self, name: str) -> Any:
        if name not in self._names:
            raise AttributeError(f"{name!r}: not in the contract")
        return lambda *args: (self.calls.append((name, *args)),
                              self._returns.get(name, lambda *a: None)(*args))[1]


@pytest.mark.parametrize("deterministic", [False, True])
def test_shipped_schemes_call_only_the_contracts(plugins, deterministic):
    """A step of each shipped scheme (its batch, its sync) against a generator and a weight
    pusher with the members of `RolloutGenerator` and `WeightPusher` alone."""
    groups = lambda n: [[SimpleNamespace(loss_mask=[True], versions=[0])]] * n   # noqa: E731
    for name, factory in _shipped(plugins, "rollout_scheme"):
        cfg = Config()
        cfg.rollout.deterministic, cfg.rollout.max_staleness = deterministic, 1
        gen = _Only(contracts.RolloutGenerator, generate=groups, take=groups)
        gen.counters, weights = Counter(), _Only(contracts.WeightPusher)
        scheme = factory(cfg, gen, weights, [])
        assert len(scheme.next_batch(0)) == cfg.rollout.groups_per_step, name
        assert scheme.sync_weights(0) == 1 and weights.calls == [("push", 1)], name


def test_agents_and_envs(plugins):
    for name, cls in _shipped(plugins, "agent"):
        assert check(cls, contracts.Agent) == [], name
    for name, cls in _shipped(plugins, "env"):
        assert check(cls, contracts.Env) == [], name
        assert isinstance(cls.__new__(cls), contracts.Env), name


def test_metric_sinks(plugins):
    from molt_core.run.metrics import MetricsSink

    for name, cls in [*_shipped(plugins, "metric_sink"), ("metrics.jsonl", MetricsSink)]:
        assert check(cls, contracts.MetricSink) == [], name


class _NoClose:
    def log(self, step, metrics): ...


class _Renamed:
    def log(self, step, values): ...
    def close(self): ...


class _TooMany:
    def log(self, step, metrics, flush): ...
    def close(self): ...


class _Async:
    async def log(self, step, metrics): ...
    def close(self): ...


class _BadEngine:
    def __init__(self, model_path, dtype="float32"): ...          # seed, ... not accepted


def test_the_checker_rejects_broken_implementations():
    assert check(_NoClose, contracts.MetricSink) == ["close: missing"]
    assert check(_Renamed, contracts.MetricSink) == [
        "log(self, step, values): needs positional or keyword parameter 'metrics' where it has "
        "'values'"]
    assert check(_TooMany, contracts.MetricSink) == [
        "log(self, step, metrics, flush): parameter 'flush' needs a default (callers never pass "
        "it)"]
    assert check(_Async, contracts.MetricSink) == ["log: must not be async"]
    problems = check(_BadEngine, contracts.Engine)
    assert "generate_batch: missing" in problems
    assert [p for p in problems if p.startswith("__init__")] == [
        f"__init__(self, model_path, dtype='float32'): needs keyword-only parameter '{k}'"
        for k in ("max_batch_size", "seed", "num_threads")]
    assert not isinstance(_NoClose(), contracts.MetricSink)


def test_the_checker_wants_async_where_the_contract_is():
    class SyncAgent:
        def rollout(self, ctx): ...

    class WithExtra:
        async def rollout(self, ctx, extra=None): ...   # an extra parameter with a default: fine

    class NoDefault:
        async def reset(self, seed): ...
        async def step(self, action=None, *, strict): ...

    assert check(SyncAgent, contracts.Agent) == ["rollout: must be async"]
    assert check(WithExtra, contracts.Agent) == []
    assert check(NoDefault, contracts.Env) == [
        "step(self, action=None, *, strict): parameter 'strict' needs a default (callers never "
        "pass it)"]


def test_scheme_attributes_are_checked_on_instances():
    class NoVersion:
        def next_batch(self, step): ...
        def sync_weights(self, step): ...

    assert check(NoVersion, contracts.RolloutScheme) == []          # a class: set in __init__
    assert check(NoVersion(), contracts.RolloutScheme) == ["version: missing attribute"]
