"""Check that every relative link and anchor of Markdown files resolves, as GitHub shows them.

`mkdocs build --strict` checks the pages under docs/ as the site renders them, but the README is not
one of them and is what a newcomer reads first, and readers follow the pages' links on GitHub too,
where anchors are made another way (`a / b` is `#a--b` there, `#a-b` on the site): a page moved or a
heading renamed must break the build for both.

    python -m ops.check_links README.md docs/*.md     # exit status 1 on any broken link
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target "title") and ![alt](target): the text may hold one level of brackets and wrap lines.
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def unfenced(text: str) -> str:
    """The text with fenced code blocks blanked, lines kept (so offsets still give line numbers)."""
    lines = text.split("\n")
    fence: str | None = None
    for i, line in enumerate(lines):
        opened = _FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0]
            lines[i] = ""
        elif fence is not None:
            if opened and opened.group(1)[0] == fence:
                fence = None
            lines[i] = ""
    return "\n".join(lines)


def prose(text: str) -> str:
    """The text with code blocks and code spans blanked, offsets kept: links there are examples."""
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), unfenced(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its visible text, lower case, punctuation dropped, spaces to
    hyphens (runs of either kept as they are, unlike Python-Markdown's)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[*~]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file offers: its headings' (with GitHub's -1, -2 for repeats) and
    explicit `<a id=...>`."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = unfenced(text)
    for line in fenced.split("\n"):
        heading = _HEADING.match(line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found.update(_HTML_ANCHOR.findall(fenced))
    return found


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline and reference link outside code."""
    body = prose(text)
    for pattern in (_INLINE, _REFERENCE):
        for match in pattern.finditer(body):
            yield body.count("\n", 0, match.start(1)) + 1, match.group(1)


def problems(path: Path) -> list[str]:
    """One line per relative link of `path` whose file or anchor does not exist."""
    text = path.read_text(encoding="utf-8")
    out: list[str] = []
    for line, target in links(text):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # another site's: not ours to check here
        where, _, anchor = target.partition("#")
        page = (path.parent / where).resolve() if where else path.resolve()
        if not page.exists():
            out.append(f"{path}:{line}: {target}: no such file")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page.read_text(encoding="utf-8")):
            out.append(f"{path}:{line}: {target}: no heading or anchor #{anchor} in {where or path.name}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="Markdown files to check")
    found = [problem for path in parser.parse_args(argv).files for problem in problems(path)]
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
