"""The one ANSI parser (ui/ansi.py): what ranks print under ipykernel's FORCE_COLOR."""

from __future__ import annotations

import pytest

from elastic_magic.ui import ansi
from elastic_magic.ui.dashboard_state import shown

pytestmark = pytest.mark.unit

RED, MAGENTA = "#e75c58", "#d160c4"


def test_colours_bold_and_resets_become_styled_runs():
    assert ansi.spans("\x1b[31mred\x1b[0m") == [(f"color: {RED}", "red")]
    assert ansi.spans("a\x1b[1;35mb\x1b[22mc\x1b[39md") == [
        ("", "a"), (f"color: {MAGENTA}; font-weight: bold", "b"), (f"color: {MAGENTA}", "c"),
        ("", "d")]
    assert ansi.spans("\x1b[1m\x1b[31mx\x1b[mplain") == [
        (f"color: {RED}; font-weight: bold", "x"), ("", "plain")]  # ESC[m resets too
    assert ansi.spans("\x1b[91;44mx") == [("color: #b22b31; background-color: #208ffb", "x")]
    assert ansi.spans("\x1b[3;4mx\x1b[23;24my") == [
        ("font-style: italic; text-decoration: underline", "x"), ("", "y")]
    inverse = ansi.spans("\x1b[7;31mx")[0][0]
    assert inverse.startswith("color: var(--jp-layout-color0") and f"background-color: {RED}" \
        in inverse
    assert ansi.spans("plain") == [("", "plain")] and ansi.spans("") == []


def test_256_colours_and_truecolour_are_shown_and_malformed_ones_dropped():
    assert ansi.spans("\x1b[38;5;196mx") == [("color: #ff0000", "x")]
    assert ansi.spans("\x1b[38;5;1mx") == [(f"color: {RED}", "x")]
    assert ansi.spans("\x1b[48;5;232mx") == [("background-color: #080808", "x")]
    assert ansi.spans("\x1b[38;2;1;2;300mx") == [("color: #0102ff", "x")]
    assert ansi.spans("\x1b[38:2:10:20:30mx") == [("color: #0a141e", "x")]  # colon form
    assert ansi.spans("\x1b[38;5mx") == [("", "x")]  # cut short: the default colour
    assert ansi.spans("\x1b[38;9;1mx\x1b[5mblink") == [("", "xblink")]


@pytest.mark.parametrize("line", [
    "\x1b[2K\x1b[1Gdone\x1b[?25h",  # rich / Lightning: erase line, column 1, show cursor
    "\x1b[?25ldone\x1b[A\x1b[K",  # hide cursor, cursor up, erase to end
    "\x1b]8;;https://x.org\x1b\\done\x1b]8;;\x1b\\",  # an OSC 8 hyperlink
    "\x1b]0;title\x07done",  # a window title
    "\x1b(Bdone\x1b7\x1b8",  # charset, save and restore the cursor
    "done\x1b[31",  # a sequence cut off at the end of the line
    "done\x1b[",
    "done\x1b",
])
def test_cursor_and_other_codes_are_dropped_whole(line):
    assert ansi.plain(line) == "done"
    assert ansi.spans(line) == [("", "done")]
    assert "\x1b" not in ansi.to_html(line)
    assert ansi.for_terminal(line) == "done"


def test_html_escapes_everything_a_rank_prints():
    html = ansi.to_html('<img src=x onerror="alert(1)">&\x1b[31m<script>\x1b[0m')
    assert html == ("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;"
                    f'<span style="color: {RED}">&lt;script&gt;</span>')
    # A sequence's bytes never reach the style: only colours the parser made.
    assert ansi.to_html('\x1b[38;2;1;2;3;"><b>m') == "&gt;&lt;b&gt;m"  # broken: dropped
    assert ansi.to_html('\x1b[38;2;1;2;3"m<b>') == "&lt;b&gt;"  # not an SGR one: dropped
    assert ansi.for_terminal('\x1b[31"mx') == "x"


def test_text_output_keeps_colours_complete_and_reset():
    assert ansi.for_terminal("\x1b[31mred\x1b[0m") == "\x1b[31mred\x1b[0m"
    # an open colour is closed at the end of the line: it never reaches the next rank's line
    assert ansi.for_terminal("\x1b[2K\x1b[1;35mepoch 1") == "\x1b[1;35mepoch 1\x1b[0m"
    assert ansi.for_terminal("\x1b[32mok\x1b[31") == "\x1b[32mok\x1b[0m"
    assert ansi.for_terminal("plain") == "plain"


def test_the_widget_gets_plain_text_and_the_runs_to_render():
    assert shown("stdout", text="plain") == ["stdout", "plain"]
    assert shown(0, "stderr", text="\x1b[2K\x1b[31mred\x1b[0m <b>") == [
        0, "stderr", "red <b>", [[f"color: {RED}", "red"], ["", " <b>"]]]
