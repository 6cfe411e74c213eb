"""The documentation's links resolve: every relative Markdown link in README.md, docs/*.md and
tasks/README.md names an existing file, and every `#anchor` a heading of its page (GitHub's anchor rule).
Task modules' pointers to their deviations (`docs/deviations.md#<benchmark>`) resolve too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "tasks" / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def github_anchor(heading: str) -> str:
    """GitHub's heading id: markup dropped, lowercase, punctuation removed (letters, digits, '-', '_' and
    spaces stay), each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The page's heading ids; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = github_anchor(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(text: str) -> list[str]:
    """Link targets outside code: fenced blocks and code spans hold commands, not links."""
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    return [t for t in LINK.findall(prose) if not EXTERNAL.match(t)]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def broken(page: Path, target: str) -> str | None:
    """Why `target` (a link on `page`) does not resolve; None when it does."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{_name(page)}: {target}: no file {path}"
    if anchor:
        if dest.suffix != ".md":
            return f"{_name(page)}: {target}: an anchor into a non-Markdown file"
        if anchor not in anchors(dest):
            return f"{_name(page)}: {target}: {dest.name} has no heading #{anchor}"
    return None


def test_anchor_rule_is_githubs():
    assert github_anchor("The one knob: `budget`") == "the-one-knob-budget"
    assert github_anchor("Choosing task, method, budget; sweeping") == "choosing-task-method-budget-sweeping"
    assert github_anchor("LongBench-v2") == "longbench-v2"
    assert (
        github_anchor("What `make eval` prints and where it lands")
        == "what-make-eval-prints-and-where-it-lands"
    )
    assert (
        github_anchor("Batching, compiled decode and the bench") == "batching-compiled-decode-and-the-bench"
    )


def test_links_skip_code_and_external(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n\n## Top\n\n[ok](#top-1) [missing](#nowhere) [file](other.md) <https://x.org>\n"
        "[web](https://example.org) `[not](a-link.md)`\n\n```\n[nor](this.md)\n# not a heading\n```\n"
    )
    assert links(page.read_text()) == ["#top-1", "#nowhere", "other.md"]
    assert anchors(page) == {"top", "top-1"}
    problems = [broken(page, t) for t in links(page.read_text())]
    assert problems[0] is None
    assert "has no heading #nowhere" in problems[1]
    assert "no file other.md" in problems[2]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    problems = [why for t in links(page.read_text()) if (why := broken(page, t))]
    assert not problems, "\n".join(problems)


def test_docs_pages_are_linked_from_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {t.partition("#")[0] for t in links(index.read_text())}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"


def test_task_modules_point_at_their_deviations():
    pointers = []
    for module in sorted((ROOT / "tasks").glob("*/*.py")):
        for target in re.findall(r"docs/[\w.-]+\.md(?:#[\w-]+)?", module.read_text()):
            pointers.append(target)
            why = broken(ROOT / "README.md", target)  # paths in docstrings are relative to the repository
            assert why is None, f"{module.relative_to(ROOT)}: {why}"
    anchors_pointed = {t.partition("#")[2] for t in pointers}
    assert {"ruler", "longbench-v2", "aime24", "livecodebench"} <= anchors_pointed
