"""Plugin manager: built-ins -> entry points (group `molt`) -> `--plugin NAME` -> `-p no:NAME`.

Built in a function, never at import. What a plugin provides shows in the hooks it implements;
registration hooks are merged into a `Registry` that names the plugin behind every entry."""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import importlib.metadata as md
import inspect
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from molt_core import HOOK_API_VERSION, __version__, hookspecs
from molt_core.config import ConfigError, type_name, type_ok

__all__ = ["KINDS", "PluginError", "Plugins", "build_plugins", "import_module"]

BUILTINS = ("molt_core.builtin",)
# registry kind -> (hook, config key it selects)
KINDS = {
    "estimator": ("molt_estimators", "algorithm.estimator"),
    "loss": ("molt_losses", "algorithm.loss"),
    "agent": ("molt_agents", "agent.name"),
    "env": ("molt_envs", None),
    "engine": ("molt_engines", "engine.name"),
    "trainer_backend": ("molt_trainer_backends", "trainer.backend"),
    "rollout_scheme": ("molt_rollout_schemes", "rollout.scheme"),
    "config_section": ("molt_config_sections", None),
    "reward": ("molt_rewards", None),
    "chat_agent": ("molt_chat_agents", None),
    "metric_sink": ("molt_metric_sinks", None),          # selected by log.sinks (a list)
}

# opt-in inputs the core passes to entries that name them (docs/plugins.md), never recipe args
SUPPLIED = {"estimator": ("rollouts",), "loss": ("group_index", "step", "ref_logprobs")}


class PluginError(RuntimeError):
    """A plugin could not be found, loaded or merged."""


@dataclass
class Plugins:
    pm: pluggy.PluginManager
    info: dict[str, dict[str, str]]                 # plugin name -> {distribution, version}
    registry: dict[str, dict[str, Any]]             # kind -> {entry name: object}
    owner: dict[tuple[str, str], str]               # (kind, entry) -> plugin name
    selected: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def get(self, kind: str, name: str, load: bool = True) -> Any:
        """Look up a registered entry; the error lists the valid names and blocked plugins
        (`load=False`: a built-in's "module:attr" stays unimported)."""
        entries = self.registry[kind]
        if name not in entries:
            valid = ", ".join(sorted(entries)) or "(none)"
            hint = f"; blocked plugins: {', '.join(self.blocked)}" if self.blocked else ""
            if close := difflib.get_close_matches(name, entries, n=1):   # the hint first
                raise PluginError(f"unknown {kind} '{name}'; did you mean '{close[0]}'? valid: "
                                  f"{valid}{hint}")
            raise PluginError(f"unknown {kind} '{name}'; valid: {valid}{hint}. Install the plugin "
                              f"that provides it (e.g. pip install molt-{kind.replace('_', '-')}-"
                              f"{name}) or fix the name in the recipe")
        if load and isinstance(entries[name], str):    # "module:attr", imported on first use
            module, attr = entries[name].split(":")
            entries[name] = getattr(importlib.import_module(module), attr)
        return entries[name]

    def selection_overrides(self) -> list[str]:
        """Config overrides implied by `--plugin NAME`: a selected plugin's sole entry of a kind
        (or its entry named NAME) becomes the run's choice for that kind."""
        out = []
        for plugin in self.selected:
            for kind, (_, key) in KINDS.items():
                mine = [e for (k, e), p in self.owner.items() if k == kind and p == plugin]
                pick = plugin if plugin in mine else (mine[0] if len(mine) == 1 else None)
                if key and pick:
                    out.append(f"{key}={pick}")
        return out

    def check_args(self, where: str, kind: str, name: str, kwargs: dict) -> None:
        """`kwargs` (config key `where`) suit entry `name`: known keyword-only (or defaulted)
        parameters, values matching their annotations, required keyword-only ones present.
        A built-in given no arguments is not imported for it (built-ins require none)."""
        if not kwargs and isinstance(self.get(kind, name, load=False), str):
            return
        fn = self.get(kind, name)
        what = f"{kind} '{name}' (plugin {self.owner[(kind, name)]})"
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.name not in SUPPLIED.get(kind, ())]
        target = inspect.unwrap(fn.__init__ if inspect.isclass(fn) else fn)
        ann = {k: a for k, a in getattr(target, "__annotations__", {}).items() if k in kwargs}
        try:    # only the keys given: resolving the others (tensors) would import torch
            hints = typing.get_type_hints(SimpleNamespace(__annotations__=ann),
                                          getattr(target, "__globals__", {}))
        except Exception:   # annotations that do not resolve here (TYPE_CHECKING imports): no check
            hints = {}
        for key, value in kwargs.items():
            if key in hints and not type_ok(value, hints[key]):
                raise ConfigError(f"{where}.{key}: {what} expects {type_name(hints[key])}, got "
                                  f"{value!r} ({type(value).__name__})")
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return
        names = {p.name for p in params if p.kind is p.KEYWORD_ONLY
                 or (p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)}
        if unknown := sorted(set(kwargs) - names):
            raise ConfigError(f"{where}: {what} does not accept {', '.join(unknown)}; "
                              f"it accepts: {', '.join(sorted(names)) or '(nothing)'}")
        if missing := [p.name for p in params if p.kind is p.KEYWORD_ONLY
                       and p.default is p.empty and p.name not in kwargs]:
            raise ConfigError(f"{where}: {what} needs {', '.join(missing)}")

    def hooks_of(self, name: str) -> list[str]:
        return sorted(c.name for c in self.pm.get_hookcallers(self.pm.get_plugin(name)) or [])


def _entry_points() -> dict[str, md.EntryPoint]:
    eps: dict[str, md.EntryPoint] = {}
    for ep in md.entry_points(group="molt"):
        if ep.name in eps and eps[ep.name].value != ep.value:
            a, b = (getattr(e.dist, "name", "?") for e in (eps[ep.name], ep))
            raise PluginError(f"two installed distributions provide the molt plugin '{ep.name}': "
                              f"{a} and {b}; uninstall one of them")
        eps[ep.name] = ep
    return eps


def build_plugins(plugins: list[str] = (), blocked: list[str] = ()) -> Plugins:
    """Build the plugin manager and the merged registry."""
    pm = pluggy.PluginManager("molt")
    pm.add_hookspecs(hookspecs)
    info: dict[str, dict[str, str]] = {}
    blocked = [b.removeprefix("no:") for b in blocked]
    for name in blocked:
        pm.set_blocked(name)
    for mod in BUILTINS:
        _register(pm, importlib.import_module(mod), mod.rsplit(".", 1)[-1], info,
                  {"distribution": "molt-core", "version": __version__})
    eps = _entry_points()
    for name, ep in eps.items():
        if name not in blocked:
            _register(pm, _load(ep), name, info, _dist(ep))
    selected = [Path(n).stem if _is_file(n) else n for n in plugins]
    for spec, name in zip(plugins, selected):
        if name in blocked:
            raise PluginError(f"plugin '{name}' is both selected (--plugin) and blocked (-p no:)")
        if name in info:
            continue
        try:
            module = import_module(spec)
        except ImportError as e:
            if not name.startswith(e.name or "\0"):        # the module exists; its import failed
                raise PluginError(f"plugin module '{name}' failed to import: {e}") from None
            valid = ", ".join(sorted(set(eps) | {n for n in info if n != "builtin"})) or "(none)"
            raise PluginError(f"unknown plugin '{name}'; installed plugins: {valid}. Install it "
                              "(pip install <package>), or name a module in the current "
                              "directory or a file (./my_plugin.py)") from None
        except Exception as e:  # a broken plugin must name itself
            raise PluginError(f"plugin module '{spec}' failed to import: {type(e).__name__}: "
                              f"{e}") from None
        _register(pm, module, name, info, {"distribution": "(module)", "version": "-"})
    _check_hook_names(pm)
    trace = bool(os.environ.get("MOLT_TRACE_PLUGINS"))
    # every hook implementation, however it is called (pluggy or directly)
    for hook in (getattr(pm.hook, n) for n in dir(pm.hook) if n.startswith("molt_")):
        for impl in hook.get_hookimpls():
            if not (impl.wrapper or impl.hookwrapper):
                impl.function = _guarded(impl.function,
                                         f"hook {hook.name} of plugin '{impl.plugin_name}'")
            if trace:
                impl.function = _traced(impl.function, f"hook {hook.name}", impl.plugin_name)
    registry, owner = _merge(pm)
    for kind, entries in registry.items():
        for entry, obj in entries.items():
            if kind in _RETURNS and inspect.isfunction(obj):
                obj = entries[entry] = _guarded(obj, f"{kind} '{entry}' (plugin "
                                                     f"{owner[(kind, entry)]})", _RETURNS[kind])
            if trace and inspect.isfunction(obj):
                entries[entry] = _traced(obj, f"{kind} '{entry}'", owner[(kind, entry)])
    return Plugins(pm, info, registry, owner, selected, blocked)


def _is_file(name: str) -> bool:
    return name.endswith(".py") or os.sep in name


def import_module(name: str) -> ModuleType:
    """Module `name` (the current directory searched last) or file `name` (`./my_env.py`: module
    `my_env`); Ray pickles their functions by value, for actors that cannot import them."""
    if _is_file(name):
        path = Path(name).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no file {name}")
        if getattr(sys.modules.get(path.stem), "__file__", str(path)) != str(path):
            raise ImportError(f"{name}: another module '{path.stem}' is imported; rename the file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)      # type: ignore[union-attr]
    else:
        path, sys.path = sys.path, [*sys.path, os.getcwd()]
        try:
            module = importlib.import_module(name)
        finally:
            sys.path = path
    if _is_file(name) or Path(getattr(module, "__file__", None) or "/").parent == Path.cwd():
        from ray import cloudpickle
        cloudpickle.register_pickle_by_value(module)
    return module


def _check_hook_names(pm: pluggy.PluginManager) -> None:
    """A misspelled hook would silently never run: name it, the plugin and the closest hook."""
    valid = sorted(n for n in dir(pm.hook) if n.startswith("molt_") and getattr(pm.hook, n).spec)
    for name in sorted(n for n in dir(pm.hook) if n.startswith("molt_") and n not in valid):
        owners = ", ".join(i.plugin_name for i in getattr(pm.hook, name).get_hookimpls())
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise PluginError(f"plugin '{owners}' implements unknown hook '{name}'; {hint}valid molt "
                          f"hooks: {', '.join(valid)}")
    pm.check_pending()


def _traced(fn: Callable, what: str, plugin: str) -> Callable:
    """`fn` printing each call (MOLT_TRACE_PLUGINS=1); signature and attributes kept."""
    def show(v: Any) -> str:
        shape = getattr(v, "shape", None)
        return f"[{', '.join(map(str, shape))}]" if shape is not None else repr(v)[:40]

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        shown = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
        print(f"molt trace: {what} (plugin {plugin})({', '.join(shown)})", file=sys.stderr)
        return fn(*args, **kwargs)
    return traced


# entries whose calls name their plugin on failure (and their return contract, if any)
_RETURNS: dict[str, tuple[Callable[[Any], bool], str] | None] = {
    "estimator": None,                 # shapes and finiteness: advantage.training_batch
    "loss": (lambda out: isinstance(out, tuple) and len(out) == 2 and hasattr(out[0], "shape")
             and isinstance(out[1], dict), "(per_token_loss [b, T], metrics dict)")}


def _returned(v: Any) -> str:
    """What a plugin returned, for an error message: its type, shape and a short repr."""
    if isinstance(v, tuple):
        return f"a {len(v)}-tuple ({', '.join(_returned(x) for x in v[:4])})"
    shape = getattr(v, "shape", None)
    return f"{type(v).__name__} {list(shape) if shape is not None else repr(v)[:40]}"


def _guarded(fn: Callable, what: str, check: tuple[Callable, str] | None = None) -> Callable:
    """`fn` whose exceptions and (with `check`) wrong returns are one PluginError naming `what`;
    molt_core's own errors (config, invariants) pass through. `molt_origin` names it elsewhere."""
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            if type(e).__module__.startswith("molt_core"):
                raise
            raise PluginError(f"{what} raised {type(e).__name__}: {e}") from e
        if check is not None and not check[0](out):
            raise PluginError(f"{what} returned {_returned(out)}; expected {check[1]}")
        return out
    guarded.molt_origin = what      # type: ignore[attr-defined]
    return guarded


def _dist(ep: md.EntryPoint) -> dict[str, str]:
    dist = ep.dist
    return {"distribution": getattr(dist, "name", "?"), "version": getattr(dist, "version", "-")}


def _load(ep: md.EntryPoint) -> ModuleType:
    try:
        return ep.load()
    except Exception as e:  # a broken plugin must name itself
        raise PluginError(f"molt plugin '{ep.name}' ({ep.value}) failed to import: "
                          f"{type(e).__name__}: {e}") from e


def _register(pm: pluggy.PluginManager, module: Any, name: str, info: dict, meta: dict) -> None:
    want = getattr(module, "MOLT_HOOK_API", None)
    try:
        ok = want is None or str(HOOK_API_VERSION) in SpecifierSet(str(want))
    except InvalidSpecifier:
        raise PluginError(f"plugin '{name}': MOLT_HOOK_API = {want!r} is not a version range "
                          "(e.g. '>=1,<2')") from None
    if not ok:
        raise PluginError(f"plugin '{name}' ({meta['distribution']} {meta['version']}) supports "
                          f"molt hook API {want}, but molt-core {__version__} has hook API "
                          f"{HOOK_API_VERSION}: install a plugin version made for it, or a "
                          "molt-core it supports")
    try:
        pm.register(module, name=name)
    except pluggy.PluginValidationError as e:
        raise PluginError(f"plugin '{name}' is invalid: {e}") from None
    info[name] = meta


def _merge(pm: pluggy.PluginManager) -> tuple[dict, dict]:
    registry: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
    owner: dict[tuple[str, str], str] = {}
    for kind, (hook, _) in KINDS.items():
        for impl in getattr(pm.hook, hook).get_hookimpls():
            entries: dict[str, Callable] = impl.function() or {}
            if not isinstance(entries, dict):
                raise PluginError(f"hook {hook} of plugin '{impl.plugin_name}' returned "
                                  f"{_returned(entries)}; expected a dict {{name: {kind}}}")
            for entry, obj in entries.items():
                if entry in registry[kind]:
                    raise PluginError(f"{kind} '{entry}' is registered by both plugin "
                                      f"'{owner[(kind, entry)]}' and plugin '{impl.plugin_name}'; "
                                      "block one with -p no:NAME")
                registry[kind][entry], owner[(kind, entry)] = obj, impl.plugin_name
    return registry, owner
