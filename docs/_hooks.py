"""MkDocs hooks for the docs build (mkdocs.yml ``hooks:``); not a page, not part of the package.

``benchmarks.md`` includes ``benchmarks/README.md`` with every heading one level down,
so the README's two top-level parts (Redis, ZooKeeper) become sections of the page and
all of them show in its table of contents. A missing file fails the build.

Syntax, on a line of its own: ``<!-- include-demoted: PATH -->``, or
``<!-- include-demoted: PATH | TITLE -->`` to retitle the file's first heading.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: A line of a page that is replaced by a repository file with its headings demoted.
MARKER = "<!-- include-demoted: "


def _demote(text: str, title: str = "") -> str:
    out: list[str] = []
    fence = ""
    for n, line in enumerate(text.splitlines()):
        if n == 0 and title and line.startswith("# "):
            line = f"# {title}"
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            mark = stripped[:3]
            fence = "" if fence == mark else (fence or mark)
        elif not fence and line.startswith("#"):
            line = "#" + line
        out.append(line)
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    root = Path(config["config_file_path"]).parent
    lines = []
    for line in markdown.splitlines():
        if line.startswith(MARKER):
            path, _, title = line[len(MARKER):].strip().removesuffix("-->").partition("|")
            lines.append(_demote((root / path.strip()).read_text(encoding="utf-8"), title.strip()))
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"
