"""The README and docs/ hold together: every relative link points at a file that exists, every `#anchor` at a
heading of its target (GitHub's slug), and the README stays short enough to read in a few minutes.

Checked: inline links and images (`[text](path#anchor)`), reference definitions (`[ref]: path`), and bare
`path.md#anchor` mentions in prose (resolved from the file's folder or the repository's root). Fenced code blocks
and code spans are not text, so what they contain is not checked. Pure text: no network, no markdown library.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_CHARS = 13_000  # a third of the 39,234 it had on 2026-12-01 (issue 54, item 4)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
BARE = re.compile(r"(?<![\w/.(\]-])((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str, spans: bool = True) -> str:
    """`text` without fenced code blocks and (with `spans`) code spans, blanked so that line numbers stay."""
    lines, fence = [], None
    for line in text.split("\n"):
        marker = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)[0] * 3
            lines.append("")
        elif fence is not None:
            if line.lstrip().startswith(fence):
                fence = None
            lines.append("")
        elif spans:
            lines.append(re.sub(r"(`+)(?:(?!\1).)+?\1", lambda m: " " * len(m.group(0)), line))
        else:
            lines.append(line)
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and underscores, as GitHub's slugger does
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; repeated headings get GitHub's -1, -2 suffixes."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(path.read_text(encoding="utf-8"), spans=False).split("\n"):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str, list[Path]]]:
    """(line, link as written, candidate targets) for every relative link and bare `.md#anchor` of a page."""
    text = _prose(page.read_text(encoding="utf-8"))
    found = []
    for pattern in (INLINE, DEFINITION):
        for match in pattern.finditer(text):
            target = match.group(1)
            if SCHEME.match(target) or target.startswith("//"):
                continue
            line = text.count("\n", 0, match.start()) + 1
            path = target.split("#", 1)[0]
            found.append((line, target, [page.parent / path if path else page]))
    for match in BARE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, match.group(0), [page.parent / match.group(1), ROOT / match.group(1)]))
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _broken(page: Path, target: str, candidates: list[Path]) -> str | None:
    """Why a link does not resolve (None: it does)."""
    existing = [c for c in candidates if c.exists()]
    if not existing:
        return "no such file"
    if "#" not in target:
        return None
    anchor = target.split("#", 1)[1]
    markdown = [c for c in existing if c.is_file() and c.suffix == ".md"]
    if not markdown:
        return None  # an anchor into a non-markdown file (a line number on GitHub) is not checked
    if any(anchor in anchors(c) for c in markdown):
        return None
    return f"no heading with anchor #{anchor} in {_shown(markdown[0])}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    problems = [f"{_shown(page)}:{line}: {target}: {why}"
                for line, target, candidates in links(page)
                if (why := _broken(page, target, candidates))]
    assert not problems, "\n".join(problems)


def test_the_readme_is_short() -> None:
    size = len((ROOT / "README.md").read_text(encoding="utf-8"))
    assert size <= README_MAX_CHARS, f"README.md has {size:,} characters; at most {README_MAX_CHARS:,}: move " \
                                     "detail into docs/ and link it"


def test_the_slug_follows_github() -> None:
    """Worked examples of GitHub's anchors, as its rendered pages show them."""
    assert slug("Differences from `trl.GRPOConfig`") == "differences-from-trlgrpoconfig"
    assert slug("Long completions at T = 16k (issue 41, item 3, CPU): `long_completions.py`") == \
        "long-completions-at-t--16k-issue-41-item-3-cpu-long_completionspy"
    assert slug("10. Padding-free forwards") == "10-padding-free-forwards"
    assert slug("A tied embedding's gradient") == "a-tied-embeddings-gradient"


def test_broken_links_are_found(tmp_path: Path) -> None:
    """Negative controls: a missing file, a missing anchor and a bare mention are each reported; code is skipped."""
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section) [gone](missing.md) [bad](other.md#nope) see other.md#nothing\n"
                    "`[code](missing.md)`\n```\n[fenced](missing.md)\n```\n[web](https://example.com/x.md)\n",
                    encoding="utf-8")
    reasons = [_broken(page, target, candidates) for _, target, candidates in links(page)]
    assert reasons.count(None) == 1 and len(reasons) == 4
    assert "no such file" in reasons
    assert sum(1 for r in reasons if r and r.startswith("no heading")) == 2
