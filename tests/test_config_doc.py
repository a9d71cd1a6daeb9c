"""`molt config RECIPE`: every key with its value and doc; the output is itself a recipe that
loads back to the same config."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path


from molt_core.cli import load
from molt_tools.commands import main
from molt_core.config import Config, to_dict
from molt_tools.config_doc import field_docs


def test_config_prints_every_key_with_its_doc_and_loads_back(tiny_recipe, tmp_path, capsys):
    assert main(["config", tiny_recipe, "trainer.steps=7", "log.format=json"]) == 0
    out = capsys.readouterr().out
    recipe = tmp_path / "printed.yaml"
    recipe.write_text(out)
    again, _ = load(str(recipe), [])
    want, _ = load(tiny_recipe, ["trainer.steps=7", "log.format=json"])
    assert to_dict(again) == to_dict(want) and again.trainer.steps == 7
    assert "  format: json" in out and "# console | json" in out
    undocumented = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
                    if dataclasses.is_dataclass(s.default_factory if s.default_factory
                                                is not dataclasses.MISSING else None)
                    for f in dataclasses.fields(s.default_factory)
                    if not dataclasses.is_dataclass(f.default_factory if f.default_factory
                                                    is not dataclasses.MISSING else None)
                    and f.name not in field_docs(s.default_factory)]
    assert not undocumented, f"config fields without a doc comment: {undocumented}"


def test_docs_links_to_pages_resolve_in_the_repo():
    """Relative links between docs pages point at files of docs/ (configuration.md was only in the
    built site; issue 41.11)."""
    docs = Path(__file__).parents[1] / "docs"
    links = {(page.name, target) for page in docs.glob("*.md")
             for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", page.read_text())}
    assert ("index.md", "configuration.md") in links
    assert [(page, t) for page, t in links if not (docs / t).is_file()] == []


def test_readme_opens_with_its_title_then_make_run_and_names_python_and_a_gpu_run():
    root = Path(__file__).parents[1]
    text = (root / "README.md").read_text()
    first_block = text.split("```\n", 2)[1]
    assert text.startswith("# Molt\n") and first_block.split()[:2] == ["make", "run"]
    python = re.search(r'requires-python = ">=([\d.]+)"', (root / "pyproject.toml").read_text())
    assert f"Python {python[1]} or newer" in text
    assert "molt run recipes/gpu/smoke-qwen3.yaml" in text
