"""README.md and docs/*.md: every relative link leads somewhere, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 320

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(markdown: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", markdown.read_text())
    slugs = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", text, re.MULTILINE):
        slugs.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return slugs


def relative_links(markdown: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(markdown.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


@pytest.mark.parametrize("markdown", DOCS, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_every_relative_link_leads_to_an_existing_file_and_heading(markdown: Path) -> None:
    broken = []
    for target in relative_links(markdown):
        path_part, _, anchor = target.partition("#")
        linked = (markdown.parent / path_part).resolve() if path_part else markdown
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(REPO_ROOT)}")
    assert not broken, f"{markdown.relative_to(REPO_ROOT)}: " + "; ".join(broken)


def test_readme_is_short() -> None:
    lines = (REPO_ROOT / "README.md").read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move details into docs/"


def test_link_check_sees_links_and_anchors(tmp_path: Path) -> None:
    """The checker itself: a link to a missing file or heading counts, a code block does not."""
    (tmp_path / "a.md").write_text(
        "# Top\n\n## `make bench`: what each phase measures\n\n"
        "[ok](#top) [ok](#make-bench-what-each-phase-measures) [gone](b.md) [web](https://example.org/x)\n"
        "```\n[not a link](nowhere.md)\n```\n"
    )
    markdown = tmp_path / "a.md"
    assert relative_links(markdown) == ["#top", "#make-bench-what-each-phase-measures", "b.md"]
    assert {"top", "make-bench-what-each-phase-measures"} <= anchors(markdown)
