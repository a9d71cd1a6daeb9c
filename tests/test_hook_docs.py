"""Every hook in hookspecs.py has its section in docs/plugins.md (and no section is stale) and a
test that exercises it."""

from __future__ import annotations

import re
from pathlib import Path

from molt_core import hookspecs

DOCS = Path(__file__).parents[1] / "docs" / "plugins.md"


def _hooks() -> set[str]:
    return {name for name, obj in vars(hookspecs).items()
            if callable(obj) and hasattr(obj, "molt_spec")}


def test_every_hook_has_a_documented_section():
    text = DOCS.read_text()
    sections = dict(re.findall(r"^## (molt_\w+)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    hooks = _hooks()
    assert hooks, "no hookspecs found: did the marker name change?"
    missing = sorted(hooks - set(sections))
    assert not missing, f"hooks without a '## <hook>' section in {DOCS.name}: {missing}"
    stale = sorted(set(sections) - hooks)
    assert not stale, f"{DOCS.name} documents hooks that do not exist: {stale}"
    for hook in hooks:                   # each section opens with the signature in backticks
        assert re.search(rf"^`{hook}\(", sections[hook], re.M), f"## {hook}: no `{hook}(...)` line"


def test_every_hook_has_a_test():
    """A hook is exercised by some test: its name appears in a test file (tests/ or a plugin's)."""
    root = Path(__file__).parents[1]
    files = [p for p in [*root.glob("tests/**/test_*.py"),
                         *root.glob("plugins/*/*/tests/test_*.py")]
             if p.resolve() != Path(__file__).resolve()]
    text = "\n".join(p.read_text() for p in files)
    untested = sorted(h for h in _hooks() if not re.search(rf"\b{h}\b", text))
    assert not untested, (f"hooks no test exercises (name them in a test under tests/ or "
                          f"plugins/*/*/tests/): {untested}")
