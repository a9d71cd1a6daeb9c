"""`molt config RECIPE [key=value ...]`: the resolved config, every key with its value (defaults
included) and its one-line doc (the comment beside the field in its dataclass)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from typing import Any, Literal

import yaml

__all__ = ["add_args", "field_docs", "main", "render"]


def field_docs(cls: type) -> dict[str, str]:
    """{field: doc} from `name: type = default  # doc` lines (and `#` lines continuing them)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    last, above = None, []
    for line in lines:
        m = re.match(r"\s{4}(\w+)\s*:[^#]*?(#\s*(.*))?$", line)
        if m and not line.strip().startswith("#"):
            last = m.group(1)
            doc = m.group(3) or " ".join(above)
            if doc:
                docs[last] = doc.strip()
            above = []
            continue
        c = re.match(r"(\s+)#\s*(.*)$", line)
        if c and last in docs and len(c.group(1)) > 8 and not above:   # continues the field's
            docs[last] += " " + c.group(2).strip()
        elif c:                                                        # above the next field
            above.append(c.group(2).strip())
    return docs


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix(
        "\n...").removesuffix("...").strip()


def render(obj: Any, indent: int = 0) -> list[str]:
    """YAML lines of a config dataclass with `# doc` comments."""
    docs, out = field_docs(type(obj)), []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, pad = getattr(obj, f.name), "  " * indent
        if dataclasses.is_dataclass(value):
            out += [f"{pad}{f.name}:" + (f"  # {docs[f.name]}" if f.name in docs else "")]
            out += render(value, indent + 1)
        elif f.name == "plugins" and isinstance(value, dict):
            for section, sub in value.items():
                out += [f"{pad}{section}:  # plugin section"] + render(sub, indent + 1)
        else:
            line = f"{pad}{f.name}: {_scalar(value)}"
            doc = docs.get(f.name)
            if typing.get_origin(hints.get(f.name)) is Literal:
                doc = f"{' | '.join(map(str, typing.get_args(hints[f.name])))}" + (
                    f": {doc}" if doc else "")
            out.append(f"{line:<44}  # {doc}" if doc else line)
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    from molt_core.cli import recipe_args
    recipe_args(p)


def main(args: argparse.Namespace) -> int:
    from molt_core.cli import load
    cfg, _ = load(args.recipe, args.overrides, args.plugin, args.blocked, weights=False)
    print("\n".join(render(cfg)))
    return 0
