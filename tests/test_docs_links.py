"""Every relative link in README.md and docs/ points at a file of the repository, and every
``#anchor`` into a Markdown page at one of its headings (GitHub's anchors).

A dead link fails with the page, the line and the target. Links to other sites are not followed
(the project reads nothing outside its repository).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline Markdown link or image outside code."""
    out, fence = [], None
    for no, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*(```|~~~)", line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence:
            continue
        line = re.sub(r"(`+).*?\1", "", line)  # inline code spans
        out += [(no, t) for t in LINK.findall(line)]
    return out


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats -1, -2."""
    seen: dict[str, int] = {}
    fence = None
    for line in text.splitlines():
        m = re.match(r"^\s*(```|~~~)", line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fence or not h:
            continue
        slug = re.sub(r"[^\w\- ]", "", h.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen.setdefault(f"{slug}-{n}", 1)
    return set(seen)


def dead_links(page: Path) -> list[str]:
    dead = []
    for line_no, target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{line_no}: {target}"
        if not dest.exists():
            dead.append(f"{where}: no such file")
        elif not dest.is_relative_to(ROOT):
            dead.append(f"{where}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            dead.append(f"{where}: no heading with that anchor in {dest.relative_to(ROOT)}")
    return dead


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert dead_links(page) == []


def test_the_check_finds_dead_links(tmp_path):
    """The checker itself: a missing file, a missing anchor, links in code are ignored."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading, with 100,000 ranks\n")
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "# Page",
        "[ok](other.md) [ok](other.md#other-page) [ok](other.md#a-code-heading-with-100000-ranks)",
        "[ok](#page) ![img](other.md) [web](https://example.com/x.md)",
        "[dead](missing.md) [dead anchor](other.md#nope)",
        "`[not a link](missing-in-code.md)`",
        "```",
        "[not a link](missing-in-block.md)",
        "```",
    ]))
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        dead = dead_links(page)
    finally:
        ROOT = saved
    assert dead == ["page.md:4: missing.md: no such file",
                    "page.md:4: other.md#nope: no heading with that anchor in other.md"]


def test_every_docs_page_is_linked_from_the_readme():
    """README.md is the front door: each page of the manual is reachable from it."""
    linked = {(ROOT / t.partition("#")[0]).resolve()
              for _, t in links((ROOT / "README.md").read_text()) if not t.startswith("#")}
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert unlinked == []
