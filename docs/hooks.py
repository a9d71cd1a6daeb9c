"""MkDocs hook: the configuration reference page, generated at build time from the config
dataclasses as `molt config` prints them (`molt_tools.config_doc.render`), so it cannot go stale.
Shipped plugins' config sections are included when their packages are installed."""

from __future__ import annotations

from mkdocs.structure.files import File, Files

PAGE = "configuration.md"

INTRO = """# Configuration reference

Every key of a recipe with its default and its doc, generated from the config dataclasses
(`molt_core.config`) when this site is built: it is what `molt config RECIPE` prints for a recipe
that sets nothing. A recipe is YAML with these sections; `key=value` on the command line
overrides any key (`trainer.steps=50`, `engine.args.max_model_len=4096`); unknown keys and wrong
types are errors that list the valid keys. Plugin sections (last) belong to the plugin of the
same name and exist only when it is installed.
"""


def config_lines() -> list[str]:
    from molt_core.config import Config
    from molt_core.plugins import build_plugins
    from molt_tools.config_doc import render

    cfg = Config()
    sections = build_plugins().registry["config_section"]
    cfg.plugins = {name: cls() for name, cls in sorted(sections.items())}
    return render(cfg)


def tables(lines: list[str]) -> list[str]:
    """`render`'s `key: value  # doc` lines as one table per top-level section."""
    out, path, top = [], [], []
    row = "| `{}` | `{}` | {} |"
    for line in lines:
        depth = (len(line) - len(line.lstrip())) // 2
        body, _, doc = line.strip().partition("  # ")      # render writes `value  # doc`
        doc = doc.replace("|", "&#124;")
        key, _, value = body.partition(":")
        path = path[:depth]
        if not value.strip():                   # a section
            path.append(key)
            if depth == 0:
                title = f"`{key}`" + (" (plugin section)" if doc == "plugin section" else "")
                out += ["", f"## {title}", ""] + ([doc, ""] if doc and doc != "plugin section"
                                                   else []) + ["| key | default | doc |",
                                                               "|---|---|---|"]
            continue
        name = ".".join(path + [key])
        (top if depth == 0 else out).append(row.format(name, value.strip(), doc))
    return ["", "## Top level", "", "| key | default | doc |", "|---|---|---|", *top, *out]


def config_page() -> str:
    lines = config_lines()
    return (INTRO + "\n".join(tables(lines)) + "\n\n## As `molt config` prints it\n\n```yaml\n"
            + "\n".join(lines) + "\n```\n")


def on_files(files: Files, config) -> Files:
    if stub := files.get_file_from_path(PAGE):     # the repo's stub, for links read off the site
        files.remove(stub)
    files.append(File.generated(config, PAGE, content=config_page()))
    return files
