"""The `molt` command: one entry per subcommand in `COMMANDS` (`run` and `validate` from
`molt_core.cli`, the rest user tools, not the training path).

Each command parses its own arguments (options and `key=value` overrides in any order), so a
usage error prints that command's usage. A command is `(help, add_args, main)` as
"module:function" strings, imported only when that command runs.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from typing import Callable

__all__ = ["COMMANDS", "main", "parse", "plugin_commands"]

# name -> (help, add_args(parser), main(args) -> exit code)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("train with a recipe", "molt_core.cli:run_args", "molt_core.cli:run"),
    "sft": ("supervised fine-tuning on chat rows (sft.data), on the same trainer",
            "molt_core.sft_trainer:sft_args", "molt_core.sft_trainer:main"),
    "validate": ("check a recipe, start nothing", "molt_core.cli:recipe_args",
                 "molt_core.cli:validate"),
    "plugins": ("list loaded plugins and the hooks they implement", "molt_core.cli:plugin_args",
                "molt_tools.plugin_info:main"),
    "config": ("print the resolved config: every key, its value and its doc",
               "molt_tools.config_doc:add_args", "molt_tools.config_doc:main"),
    "report": ("PNG plots of one or more runs' metrics (overlaid)",
               "molt_tools.report:add_args", "molt_tools.report:main"),
    "view": ("browse saved trajectories: HTML pages (RUN_DIR/view/), or the terminal",
             "molt_tools.view:add_args", "molt_tools.view:main"),
    "tiny-model": ("build a tiny random-init model + tokenizer locally",
                   "molt_tools.tiny:add_args", "molt_tools.tiny:main"),
    "new-plugin": ("generate a plugin package (pyproject, module, test)",
                   "molt_tools.scaffold:add_args", "molt_tools.scaffold:main"),
    "pretrained": ("convert a packaged pretrained model into a plain HF directory (offline)",
                   "molt_tools.pretrained:add_args", "molt_tools.pretrained:main"),
    "eval": ("evaluate a model or checkpoint on a recipe's held-out prompts",
             "molt_tools.evaluate:add_args", "molt_tools.evaluate:main"),
    "serve": ("serve the recipe's policy to agents (engine + chat server, no training)",
              "molt_tools.agent_dev:serve_args", "molt_tools.agent_dev:serve"),
    "rollout": ("run the recipe's agent N times, save and show the trajectories (no training)",
                "molt_tools.agent_dev:rollout_args", "molt_tools.agent_dev:rollout"),
    "export": ("a checkpoint (or a run dir: its latest) as a plain HF model directory",
               "molt_tools.export:add_args", "molt_tools.export:main"),
}


R = "recipes/cpu/next_letter.yaml"
CALC = ("  (its model, built once: python -m molt_tools.calculator_model "
        ".cache/tiny-qwen3-calculator)")
EXAMPLES: dict[str, list[str]] = {
    "run": [f"molt run {R} trainer.steps=50 seed=1", "molt run --resume runs/next_letter-20261201-120000"],
    "sft": ["molt sft recipes/cpu/smollm2_agent.yaml sft.data=demos.jsonl sft.epochs=3"],
    "validate": [f"molt validate {R} algorithm.estimator=rloo"],
    "plugins": ["molt plugins", "molt plugins -p no:sink_wandb"],
    "config": [f"molt config {R} trainer.lr=3e-4"],
    "report": ["molt report runs/a runs/b --out compare --x time --smoothing 0.9"],
    "view": ["molt view RUN_DIR", "molt view RUN_DIR --single --step 10",
             "molt view RUN_DIR --terminal --step 10"],
    "tiny-model": ["molt tiny-model .cache/tiny-chars --chars"],
    "new-plugin": ["molt new-plugin --kind estimator my_adv"],
    "pretrained": ["molt pretrained smollm2-135m-instruct .cache/smollm2-135m-instruct"],
    "eval": [f"molt eval RUN_DIR/final recipes/cpu/addition.yaml eval.prompts=64"],
    "serve": ["molt serve recipes/cpu/chat_calculator.yaml --port 8000", CALC],
    "rollout": ["molt rollout recipes/cpu/chat_calculator.yaml -n 4", CALC],
    "export": ["molt export RUN_DIR hf-model"],
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _resolve(target: str) -> Callable:
    module, fn = target.split(":")
    return getattr(importlib.import_module(module), fn)


def plugin_commands() -> dict[str, tuple[str, str, str]]:
    """COMMANDS and the subcommands plugins add (`molt_cli_commands`), which may not replace one."""
    from molt_core.plugins import PluginError, build_plugins
    out = dict(COMMANDS)
    for impl in build_plugins().hook.molt_cli_commands.get_hookimpls():
        for name, command in (impl.function() or {}).items():
            if name in out:
                raise PluginError(f"plugin '{impl.plugin_name}' registers the molt command "
                                  f"'{name}', which exists already")
            out[name] = command
    return out


def _top_parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS)) + 2
    listing = "\n".join(f"  {n:<{width}}{h}" for n, (h, _, _) in COMMANDS.items())
    p = argparse.ArgumentParser(prog="molt", usage="molt [--version] COMMAND [ARGS]",
                                description="Reinforcement learning for LLM agents.",
                                epilog=f"commands:\n{listing}\n\n`molt COMMAND -h` for its options",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="store_true", help="core, hook API and plugin versions")
    p.add_argument("command", nargs="?", metavar="COMMAND")
    return p


def parse(argv: list[str]) -> argparse.Namespace | None:
    """The command's arguments (`.command`, `.argv` added); None after `--version`."""
    top = _top_parser()
    split = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    ns = top.parse_args(argv[:split + 1])
    if ns.version:
        print(_resolve("molt_tools.plugin_info:version")())
        return None
    commands = COMMANDS if ns.command in COMMANDS or not ns.command else plugin_commands()
    if ns.command not in commands:
        close = difflib.get_close_matches(ns.command or "", commands, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        top.error(f"unknown command {ns.command!r}{hint}" if ns.command else "a COMMAND is required")
    help_, add_args, _ = commands[ns.command]
    examples = "\n".join(f"  {e}" for e in EXAMPLES.get(ns.command, []))
    sub = argparse.ArgumentParser(prog=f"molt {ns.command}", description=help_,
                                  epilog=f"examples:\n{examples}" if examples else None,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    _resolve(add_args)(sub)
    sub.add_argument("-v", "--verbose", action="count", default=0,
                     help="more log output (-v: DEBUG); default from $MOLT_LOG_LEVEL, else INFO")
    sub.add_argument("-q", dest="quieter", action="count", default=0,
                     help="less log output (-q: WARNING, -qq: ERROR)")
    args = sub.parse_intermixed_args(argv[split + 1:])
    args.command, args.argv, args.molt_main = ns.command, argv, commands[ns.command][2]
    args.log_level = _log_level(args.verbose - args.quieter)
    return args


def _log_level(shift: int) -> str:
    """$MOLT_LOG_LEVEL (default INFO) moved by -v / -q."""
    env = os.environ.get("MOLT_LOG_LEVEL", "INFO").upper()
    if env not in LOG_LEVELS:
        raise SystemExit(f"error: MOLT_LOG_LEVEL={env!r}: use one of {', '.join(LOG_LEVELS)}")
    return LOG_LEVELS[min(max(LOG_LEVELS.index(env) - shift, 0), len(LOG_LEVELS) - 1)]


def main(argv: list[str] | None = None) -> int:
    # the CLI's own progress lines only: no tqdm bars from transformers / huggingface_hub (read
    # when they are imported, which a command's parser may do)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = parse(sys.argv[1:] if argv is None else list(argv))
    if args is None:
        return 0
    from molt_core.config import ConfigError
    from molt_core.run.metrics import RunDirError, configure_logging
    from molt_core.plugins import PluginError
    configure_logging(args.log_level)
    try:
        return _resolve(args.molt_main)(args)
    except (ConfigError, PluginError, RunDirError) as e:   # may come late (once Ray is up)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:       # a failure-rate stop: the agent_error lines say the rest
        from molt_core.rollout.generator import FailureRateError
        if not isinstance(e, FailureRateError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
