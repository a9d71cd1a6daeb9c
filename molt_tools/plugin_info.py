"""`molt plugins` and `molt --version`: what is installed and what each plugin provides."""

from __future__ import annotations

import argparse

from molt_core.plugins import PluginError, _dist, _entry_points, build_plugins


def main(args: argparse.Namespace) -> int:
    plugins = build_plugins(args.plugin, args.blocked)
    for name, meta in sorted(plugins.info.items()):
        provides = ", ".join(f"{k}:{e}" for (k, e), p in plugins.owner.items() if p == name)
        print(f"{name}  ({meta['distribution']} {meta['version']})\n"
              f"    hooks:    {', '.join(plugins.hooks_of(name))}\n    provides: {provides}")
    return 0


def version() -> str:
    """From the installed distributions' metadata: no plugin is imported (fast)."""
    from molt_core import HOOK_API_VERSION, __version__
    lines = [f"molt-core {__version__} (hook API {HOOK_API_VERSION})"]
    try:
        eps = _entry_points()
    except PluginError as e:
        return "\n".join([*lines, f"plugins: error: {e}"])
    for name, ep in sorted(eps.items()):
        lines.append("  {}: {distribution} {version}".format(name, **_dist(ep)))
    return "\n".join(lines)
