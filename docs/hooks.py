"""mkdocs hooks (mkdocs.yml `hooks:`): every repository file a page names in code, like `cluster.yaml` or
`tests/test_ray_up.py`, becomes a link a reader can open.

With `repo_url` set (mkdocs.yml reads it from RAYSWEEP_REPO_URL when the site is built), the link goes to the file in
the repository's web view (`<repo_url>/blob/main/<path>`). Without it, the file is shipped with the site, as text, under
`src/` (`src/tests/test_ray_up.py.txt`), so that the links hold wherever the site is served, even from a folder.
Code blocks are left alone; a span already inside a link is left alone.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^( {0,8})(```|~~~)")
# a code span that is not already a link's text: `path`, not [`path`](…)
SPAN = re.compile(r"(?<!\[)`([A-Za-z0-9_.][A-Za-z0-9_./-]*\.[A-Za-z0-9]+)`(?!\]\()")
SHIPPED = "src"


def cited(text: str) -> str | None:
    """The repository file a code span names, or None (a command, a key, a file that is not in the repository)."""
    if ".." in text or text.startswith(("/", "docs/assets/")):
        return None
    path = ROOT / text
    return text if path.is_file() and not text.startswith(".") else None


def _spans(markdown: str):
    """(line number, match) of each code span outside fenced blocks."""
    fenced = None
    for number, line in enumerate(markdown.split("\n")):
        if fence := FENCE.match(line):
            fenced = None if fenced == fence.group(2) else (fenced or fence.group(2))
            continue
        if fenced is None:
            for match in SPAN.finditer(line):
                yield number, match


def on_files(files, config):
    if config.repo_url:
        return files
    paths = set()
    for file in files.documentation_pages():
        text = Path(file.abs_src_path).read_text()
        paths.update(p for _, m in _spans(text) if (p := cited(m.group(1))))
    for path in sorted(paths):
        files.append(File.generated(config, f"{SHIPPED}/{path}.txt", abs_src_path=str(ROOT / path),
                                    inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown, page, config, files):
    lines = markdown.split("\n")
    edits: dict[int, list] = {}
    for number, match in _spans(markdown):
        if path := cited(match.group(1)):
            edits.setdefault(number, []).append((match, path))
    for number, found in edits.items():
        line = lines[number]
        for match, path in reversed(found):
            if config.repo_url:
                target = f"{config.repo_url.rstrip('/')}/blob/main/{path}"
            else:
                here = posixpath.dirname(page.file.src_uri)
                target = posixpath.relpath(f"{SHIPPED}/{path}.txt", here or ".")
            line = f"{line[:match.start()]}[`{path}`]({target}){line[match.end():]}"
        lines[number] = line
    return "\n".join(lines)
