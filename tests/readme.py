"""The code blocks of the README and of the docs site's pages, as a reader copies them, for
the tests that run them.

A block is an indented (or fenced) run of lines. A MyST directive (```{code-cell}, ```{toctree},
...) is not one: the docs build runs a page's code cells itself. Tests name the block they
run by its first line (and, where two begin alike, a text that comes before it in the same
page); ``test_readme`` finds those calls in every test file and fails on a block that no
test runs and that is not listed there with the reason it cannot run."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def documents() -> list[Path]:
    """The README, then every page of the docs site (its sources, not what a build wrote)."""
    pages = [page for page in sorted(DOCS.rglob("*.md"))
             if not any(part.startswith(("_", ".")) or part == "jupyter_execute"
                        for part in page.relative_to(DOCS).parts[:-1])]
    return [README, *pages]


@dataclass(frozen=True)
class Block:
    line: int  # of its first line in its page, from 1
    text: str
    page: str = "README.md"  # from the repository's root

    @property
    def first(self) -> str:
        return self.text.splitlines()[0]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(text: str | None = None, page: str = "README.md") -> list[Block]:
    """Every code block of a page (the README's by default): lines indented by four spaces
    after a blank line (blank lines inside kept), and fenced ones that are no directive."""
    lines = (README.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    current: list[str] = []
    start = 0
    fenced = directive = False

    def close() -> None:
        while current and not current[-1].strip():
            current.pop()
        if current:
            found.append(Block(start, "\n".join(current), page))
        current.clear()

    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if fenced and not directive:
                close()
            elif not fenced:
                directive = line[3:].lstrip().startswith("{")
            fenced, start = not fenced, number + 1
            continue
        if fenced:
            if not directive:
                current.append(line)
        elif line.startswith("    ") and (current or not lines[number - 2].strip()):
            if not current:
                start = number
            current.append(line[4:])
        elif not line.strip() and current:
            current.append("")
        elif current:
            close()
    close()
    return found


def all_blocks() -> list[Block]:
    """The code blocks of the README and of every docs page."""
    return [b for path in documents()
            for b in blocks(path.read_text(), str(path.relative_to(ROOT)))]


def block(first: str, after: str = "") -> Block:
    """The block of the README or a docs page whose first line starts with ``first`` (the
    first such after the text ``after`` in the first page that has that text, if given;
    without it there must be one only, in all the pages)."""
    matches: list[Block] = []
    for path in documents():
        text = path.read_text()
        if after and after not in text:
            continue
        line_of_after = text.count("\n", 0, text.index(after)) + 1 if after else 0
        matches += [b for b in blocks(text, str(path.relative_to(ROOT)))
                    if b.first.startswith(first) and b.line > line_of_after]
        if after:
            break
    if not matches or (not after and len(matches) > 1):
        raise LookupError(f"the README and the docs have {len(matches)} code blocks starting "
                          f"{first!r}" + (f" after {after!r}" if after else ""))
    return matches[0]


def cells(first: str, after: str = "", fill: dict[str, str] | None = None) -> list[str]:
    """The block's notebook cells: a line that starts with ``%`` after a blank line starts
    the next one. ``fill`` replaces a placeholder line (``...one step...``) with code,
    indented as the placeholder was."""
    found: list[list[str]] = [[]]
    previous = ""
    for line in block(first, after).text.splitlines():
        if line.startswith("%") and not previous.strip() and found[-1]:
            found.append([])
        found[-1].append(_filled(line, fill or {}))
        previous = line
    return ["\n".join(cell).strip("\n") for cell in found]


def _filled(line: str, fill: dict[str, str]) -> str:
    stripped = line.strip()
    if not re.fullmatch(r"\.\.\..*\.\.\.", stripped):
        return line
    if stripped not in fill:
        raise KeyError(f"placeholder {stripped!r}: give its code in fill=")
    indent = line[:len(line) - len(line.lstrip())]
    return "\n".join(indent + part for part in fill[stripped].splitlines())


def magic(cell: str) -> tuple[str, str]:
    """A cell's ``%%elastic`` flags and its body."""
    line, _, body = cell.partition("\n")
    if not line.startswith("%%elastic"):
        raise ValueError(f"not a %%elastic cell: {line!r}")
    return line.removeprefix("%%elastic").strip(), body + "\n"
