"""Citations of the design document name sections it has, under its real path."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
_TEXT_SUFFIXES = {".py", ".pyi", ".md", ".yaml", ".toml", ".proto", ".cc", ".sh"}
_NOT_SOURCES = {"build", "runs", "__pycache__"}
# "docs/design.md section 2", "... sections 1 and 5", "... section 2, step 2".
_CITATION = re.compile(r"docs/design\.md,?\s+sections?\s+(\d+(?:(?:,\s*|\s+and\s+)\d+)*)")
_SECTION = re.compile(r"^## (\d+)\. ", re.MULTILINE)
# The design document under any other name: the old root file, a bare
# "DESIGN section 3", or design.md without its folder.
_STALE = re.compile(r"\bDESIGN\b|(?<!docs/)(?i:\bdesign\.md\b)")


def _skipped(part: str) -> bool:
    """Folders of tools, builds and runs (.git, .venv, caches, build output, run data)."""
    return part.startswith(".") or part in _NOT_SOURCES or part.endswith(".egg-info")


def _sources() -> list[Path]:
    return sorted(
        path
        for path in REPO.rglob("*")
        if (path.suffix in _TEXT_SUFFIXES or path.name == "Makefile")
        and path.is_file()
        and not any(_skipped(part) for part in path.relative_to(REPO).parts)
    )


def cited_sections(text: str) -> list[int]:
    return [
        int(number)
        for match in _CITATION.finditer(text)
        for number in re.findall(r"\d+", match.group(1))
    ]


def stale_references(text: str) -> list[str]:
    return [match.group(0) for match in _STALE.finditer(text)]


def test_citation_forms_are_read():
    assert cited_sections("(docs/design.md section 2, step 2)") == [2]
    assert cited_sections("docs/design.md sections 1 and 5") == [1, 5]
    assert cited_sections("docs/design.md\nsection 10") == [10]
    assert stale_references("see DESIGN.md section 3, DESIGN section 4") == ["DESIGN", "DESIGN"]
    assert stale_references("see design.md section 3") == ["design.md"]
    assert stale_references("see docs/design.md section 3") == []


def test_the_design_numbers_its_sections_from_1_without_gaps():
    numbers = [int(n) for n in _SECTION.findall(DESIGN.read_text())]
    assert numbers == list(range(1, len(numbers) + 1))


def test_the_repository_cites_the_design():
    assert sum(len(cited_sections(p.read_text())) for p in _sources()) >= 20


def test_every_citation_names_an_existing_section_of_docs_design():
    sections = {int(n) for n in _SECTION.findall(DESIGN.read_text())}
    problems = []
    for path in _sources():
        text = path.read_text()
        missing = [n for n in cited_sections(text) if n not in sections]
        if missing:
            problems.append(f"{path}: cites sections {missing}, which docs/design.md lacks")
        if path != Path(__file__) and stale_references(text):
            problems.append(f"{path}: cites {stale_references(text)}, not docs/design.md")
    assert not problems, "\n".join(problems)


# A Markdown link or image to a relative target: [text](target) or ![alt](target).
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def relative_links(text: str) -> list[str]:
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_links_are_read():
    text = "[a](docs/a.md) ![b](images/b.png) [c](https://x.org/c) [d](d.md#part)"
    assert relative_links(text) == ["docs/a.md", "images/b.png", "d.md"]


def test_every_relative_link_of_the_readme_and_the_docs_exists():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [
        f"{page.relative_to(REPO)}: {target}"
        for page in pages
        for target in relative_links(page.read_text())
        if not (page.parent / target).exists()
    ]
    assert not broken, "\n".join(broken)
