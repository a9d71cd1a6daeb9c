"""`molt run` and `molt validate`: a recipe and its plugins loaded and cross-checked (`load`), and
the training run. The dispatcher and tool commands: `molt_tools.commands` (the console script)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import structlog

from molt_core.config import Config, ConfigError, load_config, to_dict
from molt_core.plugins import KINDS, PluginError, Plugins, build_plugins

__all__ = ["check_against_plugins", "load", "plugin_args", "recipe_args", "run",
           "run_args", "start", "validate"]


def plugin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="NAME",
                   help="load and select a plugin (entry-point name or module path)")
    p.add_argument("-p", dest="blocked", action="append", default=[], metavar="no:NAME",
                   help="block a plugin")


def recipe_args(p: argparse.ArgumentParser, **recipe: Any) -> None:
    """RECIPE (`recipe`: its add_argument options), key=value overrides, the plugin options."""
    p.add_argument("recipe", **recipe)
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                   help="config overrides (before or after options); see the examples below")
    plugin_args(p)


def run_args(p: argparse.ArgumentParser) -> None:
    recipe_args(p, nargs="?", help="with --resume: optional (default: the run's config)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: one log line per step instead (for logs and CI)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its latest "
                   "checkpoint (the config may change only in checkpoint.SAFE_TO_CHANGE)")
    p.add_argument("--checkpoint", metavar="PATH", help="with --resume: this checkpoint")


def _lineage(cfg: Config) -> None:
    if cfg.model.init_from:
        from molt_core.run.checkpoint import init_from
        init_from(cfg)


def load(recipe: str | None, overrides: list[str], plugin_names: list[str] = (),
         blocked: list[str] = (), weights: bool = True, agent: bool = True
         ) -> tuple[Config, Plugins]:
    """Plugins, then config (recipe < --plugin selections < key=value), then cross-checks;
    `weights` False: missing model weights are a warning (`molt config`), not an error; `agent`
    False (`molt sft`): a recipe without agent.args needs none."""
    if bad := [b for b in blocked if not b.startswith("no:")]:
        raise PluginError(f"-p takes no:NAME to block a plugin (got {bad[0]!r})")
    plugins = build_plugins(plugin_names, blocked)
    cfg = load_config(recipe, plugins.selection_overrides() + list(overrides),
                      plugins.registry["config_section"], _lineage)
    check_against_plugins(cfg, plugins, agent or bool(cfg.agent.args))
    if not any(any(Path(cfg.model.path).glob(p)) for p in ("*.safetensors", "*.bin")):
        problem = (f"model.path '{cfg.model.path}' has no weights (*.safetensors or "
                   "pytorch_model*.bin): point it at a complete HF model directory")
        if weights:
            raise ConfigError(problem)
        structlog.get_logger("molt").warning(problem)
    plugins.hook.molt_configure(cfg=cfg, plugins=plugins)
    return cfg, plugins


def check_against_plugins(cfg: Config, plugins: Plugins, agent: bool = True) -> None:
    """Every named component exists and accepts the arguments the recipe passes it."""
    for kind, (_, key) in KINDS.items():
        if key:
            section, field = key.split(".")
            plugins.get(kind, getattr(getattr(cfg, section), field), load=False)
    for name in cfg.log.sinks:
        plugins.get("metric_sink", name, load=False)
    a = cfg.algorithm
    plugins.check_args("algorithm.estimator_args", "estimator", a.estimator, a.estimator_args)
    plugins.check_args("algorithm.loss_args", "loss", a.loss, a.loss_args)
    if agent:
        plugins.check_args("agent.args", "agent", cfg.agent.name, cfg.agent.args)
    plugins.check_args("engine.args", "engine", cfg.engine.name, cfg.engine.args)
    clip = sorted(k for k in a.loss_args if "clip" in k)
    if clip and cfg.trainer.mini_batches * cfg.trainer.epochs == 1:
        structlog.get_logger("molt").warning(
            f"algorithm.loss_args {clip} do not act: the loss's ratio is pi_theta/pi_prox (the "
            "trainer's own log-probs), which is 1 with one optimizer step per batch; "
            "set trainer.mini_batches > 1 for a trust region")


def validate(args: argparse.Namespace) -> int:
    cfg, plugins = load(args.recipe, args.overrides, args.plugin, args.blocked)
    from molt_core.trainer import prepare
    prepare(cfg, plugins)       # what `molt run` checks before it starts anything
    print(f"ok: {args.recipe} (estimator={cfg.algorithm.estimator}, loss={cfg.algorithm.loss}"
          f", agent={cfg.agent.name}, scheme={cfg.rollout.scheme}, engine={cfg.engine.name})")
    return 0


def run(args: argparse.Namespace) -> int:
    _, history = start(args.recipe, args.overrides, args.plugin, args.blocked, resume=args.resume,
                       progress=not args.no_progress, checkpoint=args.checkpoint,
                       argv=["molt", *args.argv], log_level=getattr(args, "log_level", "INFO"))
    if steps := [h for h in history if "reward/mean" in h]:      # not the eval rows
        first, last = steps[0]["reward/mean"], steps[-1]["reward/mean"]
        print(f"reward: first step {first:.3f} -> last step {last:.3f} ({len(steps)} steps)")
    return 0


def start(recipe: str | None, overrides: list[str], plugin_names: list[str] = (),
          blocked: list[str] = (), *, progress: bool = True, resume: str | None = None,
          checkpoint: str | None = None, argv: list[str] = (), log_level: str = "INFO"
          ) -> tuple[Path, list[dict]]:
    """A training run (`molt run`, `molt_core.train`): its directory and metrics rows."""
    if resume:
        from molt_core.run.checkpoint import prepare_resume, resume_recipe
        recipe, overrides = resume_recipe(resume, recipe, overrides)
    if recipe is None and not overrides:
        raise ConfigError("molt run needs a recipe (or --resume RUN_DIR)")
    from molt_core.run.cluster import prestart
    with prestart(recipe, overrides):     # Ray starts while the plugins import
        cfg, plugins = load(recipe, overrides, plugin_names, blocked)
        from molt_core.trainer import prepare, train
        prepared, ckpt = prepare(cfg, plugins), None   # its refusals: no run dir, no Ray
    from molt_core.run.metrics import configure_logging, make_run_dir
    configure_logging(log_level, fmt=cfg.log.format)
    if resume:
        run_dir, ckpt = prepare_resume(resume, checkpoint, cfg, list(argv))
    else:
        run_dir = make_run_dir(cfg.out_dir, cfg.name, to_dict(cfg), plugins.info, cfg.seed,
                               list(argv))
    print(f"run dir: {run_dir}" + (f" (resuming {ckpt.name})" if ckpt else ""), file=sys.stderr)
    return run_dir, train(cfg, plugins, run_dir, progress, ckpt, prepared)


if __name__ == "__main__":          # `python -m molt_core.cli ...`: `molt ...`, as `-m molt_core`
    import molt_core.__main__       # noqa: F401
