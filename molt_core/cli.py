"""`molt run | validate | plugins | tiny-model | new-plugin`."""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any

from molt_core.config import Config, ConfigError, load_config, to_dict
from molt_core.plugins import KINDS, PluginError, Plugins, build_plugins

__all__ = ["load", "main"]

CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 ?!.,:;+-*/=()"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="molt", description="Reinforcement learning for LLM agents.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in [("run", "train with a recipe"), ("validate", "check a recipe, start nothing")]:
        s = sub.add_parser(name, help=help_)
        s.add_argument("recipe")
        s.add_argument("overrides", nargs="*", help="key=value, e.g. trainer.steps=50 seed=1")
    pl = sub.add_parser("plugins", help="list loaded plugins and the hooks they implement")
    tiny = sub.add_parser("tiny-model", help="build a tiny random-init model + tokenizer locally")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen3_moe", "qwen3_vl"],
                      help="qwen3_vl: with a tiny vision tower and its image processor")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--chars", action="store_true",
                      help="character-level tokenizer (a ~50-token action space for toy recipes)")
    new = sub.add_parser("new-plugin", help="generate a plugin package (pyproject, module, test)")
    new.add_argument("name", help="plugin (entry-point) name, a lowercase identifier")
    new.add_argument("--kind", required=True, choices=["estimator", "agent", "rollout"])
    new.add_argument("--dir", default=".", help="parent directory of the package (default: .)")
    for s in (*(sub.choices[n] for n in ("run", "validate")), pl):
        s.add_argument("--plugin", action="append", default=[], metavar="NAME",
                       help="load and select a plugin (entry-point name or module path)")
        s.add_argument("-p", dest="blocked", action="append", default=[], metavar="no:NAME",
                       help="block a plugin")
    run = sub.choices["run"]
    run.add_argument("--no-progress", action="store_true")
    return p


def load(recipe: str | None, overrides: list[str], plugin_names: list[str] = (),
         blocked: list[str] = ()) -> tuple[Config, Plugins]:
    """Plugins, then config (recipe < --plugin selections < key=value), then cross-checks."""
    bad = [b for b in blocked if not b.startswith("no:")]
    if bad:
        raise PluginError(f"-p takes no:NAME to block a plugin (got {bad[0]!r})")
    plugins = build_plugins(plugin_names, blocked)
    cfg = load_config(recipe, plugins.selection_overrides() + list(overrides),
                      plugins.registry["config_section"])
    check_against_plugins(cfg, plugins)
    plugins.hook.molt_configure(cfg=cfg)
    return cfg, plugins


def check_against_plugins(cfg: Config, plugins: Plugins) -> None:
    """Every named component exists and accepts the arguments the recipe passes it."""
    for kind, (_, key) in KINDS.items():
        if key:
            section, field = key.split(".")
            plugins.get(kind, getattr(getattr(cfg, section), field))
    _check_kwargs("algorithm.estimator_args", plugins.get("estimator", cfg.algorithm.estimator),
                  cfg.algorithm.estimator_args)
    _check_kwargs("algorithm.loss_args", plugins.get("loss", cfg.algorithm.loss),
                  cfg.algorithm.loss_args)
    _check_kwargs("agent.args", plugins.get("agent", cfg.agent.name), cfg.agent.args)
    _check_kwargs("engine.args", plugins.get("engine", cfg.engine.name), cfg.engine.args)


def _check_kwargs(where: str, fn: Any, kwargs: dict) -> None:
    """Hyper-parameters are the keyword-only (or defaulted) parameters of a component."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params
             if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ConfigError(f"{where}: {fn.__qualname__} does not accept {', '.join(unknown)}; "
                          f"it accepts: {', '.join(sorted(names)) or '(nothing)'}")


def _list_plugins(plugins: Plugins) -> None:
    for name, meta in plugins.info.items():
        provides = ", ".join(f"{k}:{e}" for (k, e), p in plugins.owner.items() if p == name)
        print(f"{name}  ({meta['distribution']} {meta['version']})\n"
              f"    hooks:    {', '.join(plugins.hooks_of(name))}\n    provides: {provides}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    from molt_core.metrics import configure_logging
    configure_logging()
    try:
        if args.cmd == "tiny-model":
            from molt_tools.tiny import build_tiny_model
            charset = CHARSET if args.chars else None
            print(build_tiny_model(args.out_dir, arch=args.arch, seed=args.seed, charset=charset))
            return 0
        if args.cmd == "new-plugin":
            from molt_tools.scaffold import new_plugin
            try:
                root = new_plugin(args.name, args.kind, args.dir)
            except (ValueError, FileExistsError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"created {root}\nnext: pip install -e {root} && pytest {root}/tests && "
                  f"molt run RECIPE --plugin {args.name}")
            return 0
        if args.cmd == "plugins":
            _list_plugins(build_plugins(args.plugin, args.blocked))
            return 0
        cfg, plugins = load(args.recipe, args.overrides, args.plugin, args.blocked)
        if args.cmd == "validate":
            print(f"ok: {args.recipe} (estimator={cfg.algorithm.estimator}, loss={cfg.algorithm.loss}"
                  f", agent={cfg.agent.name}, scheme={cfg.rollout.scheme}, engine={cfg.engine.name})")
            return 0
    except (ConfigError, PluginError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from molt_core.metrics import make_run_dir
    from molt_core.trainer import train
    run_dir = make_run_dir(cfg.out_dir, cfg.name, to_dict(cfg), plugins.info, cfg.seed,
                           ["molt", *argv])
    print(f"run dir: {run_dir}", file=sys.stderr)
    try:
        history = train(cfg, plugins, run_dir, progress=not args.no_progress)
    except ConfigError as e:       # found once Ray is up: the cluster cannot hold the run
        print(f"error: {e}", file=sys.stderr)
        return 2
    if history:
        first, last = history[0]["reward/mean"], history[-1]["reward/mean"]
        print(f"reward: first step {first:.3f} -> last step {last:.3f} ({len(history)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
