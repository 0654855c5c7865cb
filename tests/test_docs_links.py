"""Every document the tree cites is in the tree: `docs/X.md` paths exist, numbered sections they cite
(`docs/engines.md §1.6`) are headings of that page, quoted section names (`docs/design.md, "Contracts"`)
start a heading there, and nothing cites the notes that live outside the repository (`DESIGN.md`,
`STYLE.md`, `reference/*.md`, or the bare names of the former reference pages)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("src", "docs", "tests", "benchmarks", "scripts", "configs", "README.md", "Makefile")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".sh", ".txt", ".toml", ""}
SKIP = {Path(__file__).resolve()}

DOC_PATH = re.compile(r"(?<![\w/.-])docs/([\w-]+)\.md")
SECTIONS = re.compile(r"(?<![\w/.-])docs/([\w-]+)\.md((?:[ ,;(]*§\d+(?:\.\d+)*(?:-\d+(?:\.\d+)*)?)+)")
SECTION_NUMBER = re.compile(r"\d+(?:\.\d+)*")
QUOTED = re.compile(r"(?<![\w/.-])docs/([\w-]+)\.md,? [\"']([^\"']+)[\"']")
OUTSIDE = re.compile(r"(?<![\w.-])(?:DESIGN|STYLE)\.md|reference/[\w-]+\.md"
                     r"|(?<![\w/.-])(?:engines|training|performance|cpu-engines|engine-capture)\.md")
HEADING = re.compile(r"^#{1,4} (.+)$", re.MULTILINE)


def cited_lines() -> list[tuple[str, int, str]]:
    rows = []
    for top in SCANNED:
        base = ROOT / top
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        for path in paths:
            if path.resolve() in SKIP or path.suffix not in TEXT_SUFFIXES or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            rel = str(path.relative_to(ROOT))
            rows += [(rel, i, line) for i, line in enumerate(text.splitlines(), 1)]
    return rows


LINES = cited_lines()


def headings(page: str) -> list[str]:
    return HEADING.findall((ROOT / "docs" / f"{page}.md").read_text(encoding="utf-8"))


def test_the_scan_sees_the_citations():
    # Guards the scan itself: these citations are known to be in the tree.
    assert any("docs/engines.md §1.6" in line for _, _, line in LINES)
    assert any('docs/design.md, "Contracts' in line for _, _, line in LINES)


def test_cited_docs_exist():
    missing = [f"{f}:{i}: docs/{m}.md" for f, i, line in LINES for m in DOC_PATH.findall(line)
               if not (ROOT / "docs" / f"{m}.md").is_file()]
    assert not missing, "cited docs pages that are not in docs/:\n" + "\n".join(missing)


def test_no_citation_of_notes_outside_the_repository():
    outside = [f"{f}:{i}: {m.group(0)}" for f, i, line in LINES for m in OUTSIDE.finditer(line)
               if not line[:m.start()].endswith("docs/")]
    assert not outside, ("citations of files that are not in the repository (point them at a docs/ page that "
                         "states the fact):\n" + "\n".join(outside))


def test_cited_sections_are_headings():
    numbers = {}
    bad = []
    for f, i, line in LINES:
        for m in SECTIONS.finditer(line):
            page = m.group(1)
            if not (ROOT / "docs" / f"{page}.md").is_file():
                continue  # reported by test_cited_docs_exist
            have = numbers.setdefault(page, {h.split()[0].rstrip(".") for h in headings(page)})
            bad += [f"{f}:{i}: docs/{page}.md §{n}" for n in SECTION_NUMBER.findall(m.group(2)) if n not in have]
    assert not bad, "cited sections with no such numbered heading:\n" + "\n".join(bad)


def test_quoted_section_names_start_a_heading():
    bad = [f"{f}:{i}: docs/{page}.md {name!r}" for f, i, line in LINES for page, name in QUOTED.findall(line)
           if (ROOT / "docs" / f"{page}.md").is_file()
           and not any(h.lower().startswith(name.lower()) for h in headings(page))]
    assert not bad, "quoted section names that start no heading of the page:\n" + "\n".join(bad)


@pytest.mark.parametrize("line, hits", [
    ("see reference/engines.md §3", 1), ("shared/reference/cpu-engines.md", 1), ("../shared/DESIGN.md", 1), ("(DESIGN.md, 'Contracts')", 1), ("engines.md §1.2", 1),
    ("docs/engines.md §1.2", 0), ("speculators `docs/cli/train.md`", 0), ("README.md", 0),
])
def test_outside_pattern(line, hits):
    found = [m for m in OUTSIDE.finditer(line) if not line[:m.start()].endswith("docs/")]
    assert len(found) == hits
