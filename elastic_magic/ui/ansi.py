"""ANSI escape sequences in what ranks print: the one parser behind the widget, the record
and ``--text``.

ipykernel sets ``FORCE_COLOR=1`` and ``CLICOLOR_FORCE=1``; workers inherit them, so rich,
Lightning's progress bars, loguru and pytest print colours and cursor codes. Jupyter renders
the colours of a cell's streams (SGR: 8/16 colours, 256 colours, truecolour, bold, italic,
underline, inverse) and drops the rest; so do we. Each line is read on its own (its colours
do not carry to the next line: a rank's lines are interleaved with other ranks'), and a
sequence cut off at the end of a line is dropped, never shown in part. Log files are not
touched: they keep every byte the rank wrote."""

from __future__ import annotations

import re
from functools import lru_cache
from html import escape

# A complete CSI sequence (SGR, a style, when its final byte is "m" with no intermediate
# bytes: group 1 its parameters, group 2 "m"), an OSC one
# (hyperlinks, titles; ended by BEL or ST, or cut off), any other escape, or what is left of
# one cut off at the end of the line.
_ESCAPE = re.compile(
    r"\x1b\[([0-?]*)(?:(m)|[ -/]*[@-~])"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[ -/]*[0-Z\\^-~]"
    r"|\x1b\[?[0-?]*[ -/]*"
)

# Jupyter's palette for the 16 colours (normal, then bright).
_PALETTE = ("#3e424d", "#e75c58", "#00a250", "#ddb62b", "#208ffb", "#d160c4", "#60c6c8",
            "#c5c1b4", "#282c36", "#b22b31", "#007427", "#b27d12", "#0065ca", "#a03196",
            "#258f8f", "#a1a6b2")
_CUBE = (0, 95, 135, 175, 215, 255)
# Where inverse video meets a default colour: the theme's.
_DEFAULT_FG = "var(--jp-content-font-color0, #000)"
_DEFAULT_BG = "var(--jp-layout-color0, #fff)"

Span = tuple[str, str]  # (CSS for a style attribute, "" when plain; the text)


def plain(line: str) -> str:
    """The line as text: every escape sequence gone."""
    return _ESCAPE.sub("", line) if "\x1b" in line else line


def for_terminal(line: str) -> str:
    """The line for a terminal or a notebook's text stream (``--text``): its colours kept
    (Jupyter renders them, as it does a plain cell's), everything else dropped (cursor
    moves and erases would fight the ``[rank N]`` prefixes and the progress line), and reset
    at its end when it set any, so a colour never leaks into the next rank's line."""
    if "\x1b" not in line:
        return line
    style = _Style()

    def keep(match: re.Match[str]) -> str:
        if not match[2]:
            return ""
        style.apply(match[1])
        return match[0]

    kept = _ESCAPE.sub(keep, line)
    return kept + "\x1b[0m" if style.css() else kept


def to_html(line: str) -> str:
    """The line as HTML: every character of the rank's text escaped, its colours as spans
    with inline styles (no class to depend on: the record lives in saved notebooks)."""
    return "".join(f'<span style="{css}">{escape(text)}</span>' if css else escape(text)
                   for css, text in spans(line))


def spans(line: str) -> list[Span]:
    """The line as styled runs of text; plain text is one run with no style."""
    if "\x1b" not in line:
        return [("", line)] if line else []
    return list(_spans(line))


@lru_cache(maxsize=4096)  # a widget's sync renders the same tails again and again
def _spans(line: str) -> tuple[Span, ...]:
    runs: list[Span] = []
    style = _Style()
    at = 0
    for match in _ESCAPE.finditer(line):
        _add(runs, style.css(), line[at:match.start()])
        at = match.end()
        if match[2] == "m":
            style.apply(match[1])
    _add(runs, style.css(), line[at:])
    return tuple(runs)


def _add(runs: list[Span], css: str, text: str) -> None:
    if not text:
        return
    if runs and runs[-1][0] == css:
        runs[-1] = (css, runs[-1][1] + text)
    else:
        runs.append((css, text))


class _Style:
    """SGR state: what ``ESC [ ... m`` sequences set, as CSS."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.fg: str | None = None
        self.bg: str | None = None
        self.bold = self.italic = self.underline = self.inverse = False

    def apply(self, params: str) -> None:
        try:
            codes = [int(p) if p else 0 for p in params.replace(":", ";").split(";")]
        except ValueError:  # private parameters ("<", "=", ">", "?"): not a style
            return
        while codes:
            code = codes.pop(0)
            if code == 0:
                self.reset()
            elif code in (1, 3, 4, 7, 22, 23, 24, 27):
                self._flag(code)
            elif 30 <= code <= 37 or 90 <= code <= 97:
                self.fg = _PALETTE[code - 30 if code < 90 else code - 82]
            elif 40 <= code <= 47 or 100 <= code <= 107:
                self.bg = _PALETTE[code - 40 if code < 100 else code - 92]
            elif code in (38, 48):
                color = _extended(codes)
                if code == 38:
                    self.fg = color
                else:
                    self.bg = color
            elif code == 39:
                self.fg = None
            elif code == 49:
                self.bg = None
            # anything else (blink, faint, strike-through, fonts) is not shown

    def _flag(self, code: int) -> None:
        on = code < 10
        match code % 20:
            case 1 | 2:
                self.bold = on
            case 3:
                self.italic = on
            case 4:
                self.underline = on
            case 7:
                self.inverse = on

    def css(self) -> str:
        fg, bg = self.fg, self.bg
        if self.inverse:
            fg, bg = bg or _DEFAULT_BG, fg or _DEFAULT_FG
        parts = []
        if fg:
            parts.append(f"color: {fg}")
        if bg:
            parts.append(f"background-color: {bg}")
        if self.bold:
            parts.append("font-weight: bold")
        if self.italic:
            parts.append("font-style: italic")
        if self.underline:
            parts.append("text-decoration: underline")
        return "; ".join(parts)


def _extended(codes: list[int]) -> str | None:
    """A 256-colour (``5;n``) or truecolour (``2;r;g;b``) argument, taken from ``codes``;
    None (the default colour) when it is malformed, and then the rest of the sequence is
    dropped too: what follows cannot be told apart from the colour's arguments."""
    kind = codes.pop(0) if codes else None
    if kind == 5 and codes:
        n = codes.pop(0)
        if n < 16:
            return _PALETTE[n]
        if n < 232:
            n -= 16
            return "#" + "".join(f"{_CUBE[c]:02x}" for c in (n // 36, n // 6 % 6, n % 6))
        if n < 256:
            return "#" + f"{8 + 10 * (n - 232):02x}" * 3
    if kind == 2 and len(codes) >= 3:
        r, g, b = (min(codes.pop(0), 255) for _ in range(3))
        return f"#{r:02x}{g:02x}{b:02x}"
    codes.clear()
    return None
