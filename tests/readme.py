"""The README's code blocks, as a reader copies them, for the tests that run them.

A block is an indented (or fenced) run of lines. Tests name the one they run by its first
line (and, where two begin alike, a text that comes before it); ``test_readme`` finds those
calls in every test file and fails on a block that no test runs and that is not listed there
with the reason it cannot run."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


@dataclass(frozen=True)
class Block:
    line: int  # of its first line in the README, from 1
    text: str

    @property
    def first(self) -> str:
        return self.text.splitlines()[0]


def blocks(text: str | None = None) -> list[Block]:
    """Every code block: lines indented by four spaces after a blank line (blank lines
    inside kept), and fenced ones."""
    lines = (README.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    current: list[str] = []
    start = 0
    fenced = False

    def close() -> None:
        while current and not current[-1].strip():
            current.pop()
        if current:
            found.append(Block(start, "\n".join(current)))
        current.clear()

    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if fenced:
                close()
            fenced, start = not fenced, number + 1
            continue
        if fenced:
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


def block(first: str, after: str = "") -> Block:
    """The block whose first line starts with ``first`` (the first such after the text
    ``after``, if given; without it there must be one only)."""
    text = README.read_text()
    offset = text.index(after) if after else 0
    line_of_after = text.count("\n", 0, offset) + 1
    matches = [b for b in blocks(text) if b.first.startswith(first) and b.line > line_of_after]
    if not matches or (not after and len(matches) > 1):
        raise LookupError(f"the README has {len(matches)} code blocks starting {first!r}"
                          + (f" after {after!r}" if after else ""))
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
        raise KeyError(f"README placeholder {stripped!r}: give its code in fill=")
    indent = line[:len(line) - len(line.lstrip())]
    return "\n".join(indent + part for part in fill[stripped].splitlines())


def magic(cell: str) -> tuple[str, str]:
    """A cell's ``%%elastic`` flags and its body."""
    line, _, body = cell.partition("\n")
    if not line.startswith("%%elastic"):
        raise ValueError(f"not a %%elastic cell: {line!r}")
    return line.removeprefix("%%elastic").strip(), body + "\n"
