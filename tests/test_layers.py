"""The layers import one way: molt_tools -> examples (molt_examples) -> plugins -> molt_core. The
core imports no plugin, example or tool, a plugin no example or tool, an example no tool, even
through a function-level import (one inside `if TYPE_CHECKING:` is for the type checker only; a
launcher, `__main__.py` or an `if __name__ == "__main__":` block, stands above every layer)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_PACKAGES = {p.parent.name for p in ROOT.glob("plugins/*/*/*/__init__.py")}
EXAMPLE_PACKAGES = {p.parent.name for p in ROOT.glob("examples/*/*/__init__.py")}
# `molt_core.evaluate`, the Python form of `molt eval`, is loaded by name from its command's module
UPWARD_BY_NAME = {"molt_core -> molt_tools.evaluate"}


def imports(path: Path) -> set[str]:
    """The modules `path` imports at run time, anywhere in it (not under `if TYPE_CHECKING:`)."""
    tree, found = ast.parse(path.read_text()), set()
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(k in ast.unparse(node.test)
                                            for k in ("TYPE_CHECKING", "__main__")):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = (package.rsplit(".", node.level - 1)[0] + "." if node.level else "")
            mod = (base + (node.module or "")).rstrip(".")
            found |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= {node.value} if node.value.split(".")[0] == "molt_tools" else set()
    return found


def sources(pattern: str) -> list[Path]:
    return [p for p in ROOT.glob(pattern) if p.name != "__main__.py" and "tests" not in p.parts]


def module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_core_imports_no_plugin_and_no_tool() -> None:
    bad = {f"{module(p)} -> {m}" for p in sources("molt_core/**/*.py") for m in imports(p)
           if m.split(".")[0] in PLUGIN_PACKAGES | EXAMPLE_PACKAGES | {"molt_tools"}}
    bad -= UPWARD_BY_NAME
    assert not bad, f"the core reaches up a layer: {sorted(bad)}"


def test_plugins_import_no_example_and_no_tool() -> None:
    assert "molt_examples" in EXAMPLE_PACKAGES
    bad = {f"{p.relative_to(ROOT)} -> {'.'.join(m.split('.')[:2])}"
           for pattern, above in (("plugins/*/*/*/**/*.py", EXAMPLE_PACKAGES | {"molt_tools"}),
                                  ("examples/*/*/**/*.py", {"molt_tools"}))
           for p in sources(pattern) for m in imports(p) if m.split(".")[0] in above}
    assert not bad, f"a plugin imports an example or a tool, or an example a tool: {sorted(bad)}"


def test_the_core_runs_one_way() -> None:
    """Within molt_core no module imports, at run time, one that imports it back (directly or
    around a longer circle). It failed on rollout/restarts.py <-> trainer.py (the log-prob gaps,
    mend 2), config.py <-> config_rules.py (mend 5) and config.py -> sft_trainer.py -> ... ->
    config.py (model.init_from)."""
    mods = {module(p): p for p in sources("molt_core/**/*.py") if p.name != "__init__.py"}
    graph = {m: {max((k for k in mods if n == k or n.startswith(k + ".")), key=len)
                 for n in imports(p) if any(n == k or n.startswith(k + ".") for k in mods)} - {m}
             for m, p in mods.items()}

    def reach(m: str) -> set[str]:
        seen, todo = set(), [m]
        while todo:
            todo += graph[n] - seen if (n := todo.pop()) not in seen else set()
            seen.add(n)
        return seen

    reached = {m: reach(m) for m in mods}
    circles = {", ".join(sorted(c)) for m in mods
               if len(c := {n for n in reached[m] if m in reached[n]}) > 1}
    assert not circles, f"modules that import each other, around a circle: {sorted(circles)}"
