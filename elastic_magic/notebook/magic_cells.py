"""What the notebook's jobs (``magics.py``) and a session's cells (``session_magic.py``)
share: how flags and cells are checked, how a cell is shown and what it returns, and the
printing of stacks. Each takes what it works on as arguments."""

from __future__ import annotations

import re
import shlex
import sys
from typing import Any

from IPython.core.error import UsageError

from ..result import JobFailedError, JobResult, JobState
from ..wire.payload import uses_ipython_syntax


def magic_words(line: str, what: str, job_refs: bool = False) -> list[str]:
    """A magic's line split as a shell would (IPython's own parse_argstring keeps quotes:
    ``--args "--lr 1"`` would reach the script as one word), and as a shell, a ``#`` that
    starts a word outside quotes starts a comment (IPython hands it to the magic); with
    ``job_refs`` (``%elastic``'s subcommands), but for a job's number (``stop #2``)."""
    try:
        return shlex.split(_without_comment(line, job_refs))
    except ValueError as exc:  # shlex: unbalanced quotes
        raise UsageError(f"{what}: {exc}; check the quotes.") from None


def _without_comment(line: str, job_refs: bool) -> str:
    """``line`` up to a comment: a ``#`` that starts a word outside quotes, unless that word
    is a job's number and ``job_refs`` (``#2`` is job 2, as the panel names it)."""
    quote, escaped = "", False
    for index, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()) and not (
                job_refs and re.match(r"#\d+(\s|$)", line[index:])):
            return line[:index]
    return line


def parse_flags(parser: Any, line: str | list[str], what: str) -> Any:
    """The magic's flags (a line: split by ``magic_words``)."""
    return parser.parse_args(magic_words(line, what) if isinstance(line, str) else line)


def require_plain_python(shell: Any, cell: str) -> None:
    """Workers run plain Python: a cell with IPython syntax is refused before it runs."""
    if uses_ipython_syntax(shell.transform_cell(cell)):
        raise UsageError("%%elastic: IPython syntax (%magics, !shell, ?help) cannot run in "
                         "workers, which are plain Python. Move it to a cell of its own.")


def parse_scale(words: list[str]) -> tuple[int, list[str], bool, tuple[int, ...]]:
    """``%elastic scale N [JOB] [--now] [--include S,...]``: the size, the words left,
    ``--now``, and the worker slots left out that the user names back."""
    now = "--now" in words
    words = [w for w in words if w != "--now"]
    include: tuple[int, ...] = ()
    if "--include" in words:
        at = words.index("--include")
        slots = words[at + 1].split(",") if at + 1 < len(words) else []
        if not slots or not all(s.isdigit() for s in slots):
            raise UsageError("%elastic scale: --include takes worker slots, for example "
                             "`--include 1` or `--include 1,3`.")
        include = tuple(int(s) for s in slots)
        words = words[:at] + words[at + 2:]
    if not words or not words[0].isdigit():
        raise UsageError("%elastic scale: how many workers? For example `%elastic scale 4`.")
    return int(words[0]), words[1:], now, include


def print_pool() -> None:
    """The warm pool's lines of ``%elastic status``: what it preloads, and each module it
    left out and why."""
    from ..agent.node.pool import warm_pool

    for line in warm_pool().describe():
        print(f"{'pool':>10}: {line}")


def forget_pool(words: list[str]) -> None:
    """``%elastic pool forget``: the pool forgets what it learned and left out."""
    if words != ["forget"]:
        raise UsageError("%elastic pool: expected `%elastic pool forget`")
    from ..agent.node.pool import warm_pool

    warm_pool().forget()
    print("the pool forgot what it learned; the next job's zygote preloads the defaults")


def say(line: str) -> None:
    """One line in one write: print() writes the line and its newline apart, and a --bg
    job's text output, written from its own thread, would land between the two
    ("... requested[elastic] resize to 3 workers ...")."""
    sys.stdout.write(line + "\n")


def print_stacks(stacks: dict[int, str]) -> None:
    for rank, text in stacks.items():
        print(f"==> rank {rank} <==\n{text}\n")


def cell_value(result: JobResult, *, shown: bool = False) -> JobResult | None:
    """What the cell returns: a failure raises; like IPython's own cells, a value is shown
    only when the cell produced one."""
    if result.state is JobState.FAILED:
        raise JobFailedError(result, shown=shown)
    return result if any(v is not None for v in result.values.values()) else None


def make_view(shell: Any, target: Any, text: bool) -> Any:
    """The live dashboard where a frontend renders widgets, else plain text. ``target``:
    a Job, or a session cell's controls."""
    if not text and getattr(shell, "kernel", None) is not None:
        from ..ui.dashboard import LiveView

        return LiveView(target)
    from ..ui.text import TextRenderer

    return TextRenderer()


def finish_view(view: Any) -> None:
    """A dashboard leaves its static record; text has nothing to finish."""
    finish = getattr(view, "finish", None)
    if finish is not None:
        finish()
