"""Every hook in hookspecs.py has its section in docs/plugins.md (and no section is stale)."""

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
