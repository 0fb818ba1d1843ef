"""The README is what a newcomer reads first: its commands, and links that lead somewhere.

`make docs` checks the pages under docs/ (mkdocs --strict) and every page's links as GitHub shows
them; these tests keep the README's promises, the docs' examples and the checker honest without mkdocs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ops import check_links
from ops.serverproc import ROOT
from streamkeep import config

README = ROOT / "README.md"


def test_readme_opens_with_the_two_commands() -> None:
    # CI and newcomers copy these lines as they are.
    assert README.read_text().split("\n")[:6] == [
        "# streamkeep",
        "",
        "```sh",
        "make serve   # run the server on http://127.0.0.1:4437, streams kept durably under ./data",
        "make test    # lint, our tests (kill -9 crash test and fault simulation included), the official "
        "conformance suite",
        "```",
    ]


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda page: page.name)
def test_links_resolve_as_github_shows_them(page: Path) -> None:
    assert check_links.problems(page) == []


def test_docs_index_lists_what_the_readme_lists() -> None:
    def table(text: str) -> str:
        return text.split("| page | what it holds |", 1)[1].split("\n\n", 1)[0].strip()

    readme = table(README.read_text()).replace("](docs/", "](").replace("[docs/", "[")
    assert table((ROOT / "docs" / "index.md").read_text()) == readme


TOML_EXAMPLES = [
    pytest.param(block, id=f"{page.name}-{n}")
    for page in sorted((ROOT / "docs").glob("*.md"))
    for n, block in enumerate(re.findall(r"```toml\n(.*?)```", page.read_text(), re.DOTALL))
]


@pytest.mark.parametrize("example", TOML_EXAMPLES)
def test_toml_examples_load(example: str, tmp_path: Path) -> None:
    # A setting renamed or given another syntax must take its examples along.
    path = tmp_path / "streamkeep.toml"
    path.write_text(example)
    if "[[pg_to_stream]]" in example or "[[stream_to_pg]]" in example:  # a sync.toml (docs/postgres-sync.md)
        from streamkeep.sync.config import load as load_sync_config

        load_sync_config(path, environ={})
        return
    config.load(str(path), env={})


def test_checker_finds_missing_pages_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## The registry: `__registry__`\n\n## A / b\n\n## A / b\n"
    )
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "[ok](docs/page.md#the-registry-__registry__) [repeat](docs/page.md#a--b-1) [self](#top)\n"
        "[gone](docs/moved.md) [wrong](docs/page.md#nowhere) [web](https://example.com/x#y)\n"
        "`[code](docs/nothing.md)`\n\n"
        "```\n[fenced](docs/nothing.md)\n```\n"
        "[wrapped\ntext](docs/away.md)\n\n"
        "[ref]: docs/elsewhere.md\n"
    )
    assert check_links.problems(readme) == [
        f"{readme}:4: docs/moved.md: no such file",
        f"{readme}:4: docs/page.md#nowhere: no heading or anchor #nowhere in docs/page.md",
        f"{readme}:11: docs/away.md: no such file",
        f"{readme}:13: docs/elsewhere.md: no such file",
    ]
