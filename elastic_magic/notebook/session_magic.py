"""The notebook's side of sessions: ``%elastic session start|stop|status``,
``%elastic push|pull|gather``, and ``%%elastic`` cells while a session is active."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from IPython.core.error import UsageError

from ..result import JobResult
from ..spec import OPTION_NAMES, SpecError
from ..wire.payload import PayloadError
from .comm import JobsChannel, current_cell_id
from .magic_cells import (
    cell_value,
    parse_flags,
    parse_scale,
    print_pool,
    print_stacks,
    require_plain_python,
)
from .session import Session, SessionEndedError

USAGE = """\
%elastic session start [job flags]   start workers that stay alive across cells
%elastic session stop | status       end the session | show it
%elastic scale N [--include S,...] | stacks   resize the session | every rank's stacks
%elastic scale --nodes N             a --launcher session: N machines in all
%elastic push NAME [NAME ...]        send kernel variables to every rank
%elastic pull NAME [--rank R]        copy a rank's variable into the kernel (rank 0)
%elastic gather NAME                 every rank's variable, as {rank: value}"""


class _CellControls:
    """What the dashboard's buttons reach for a session's cell: Stop interrupts the cell."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.run_id = session.run_id
        self.spec = session.spec
        self.log_dir = session.spec.log_dir / session.run_id

    def stop(self, reason: str = "stopped") -> None:
        self.session.interrupt()

    def scale(self, nproc: int, immediate: bool = False, include: tuple[int, ...] = ()) -> None:
        self.session.scale(nproc, include=include)

    def request_stacks(self) -> Future[dict[int, str]]:
        return self.session.request_stacks()


class SessionCommands:
    """This kernel's session, as the magics drive it (one at a time): ``parser`` is
    %%elastic's (a session takes a job's flags), ``channel`` the lab panel's, ``numbers``
    the kernel's count of jobs and sessions."""

    def __init__(self, shell: Any, parser: Any, channel: JobsChannel,
                 numbers: Iterator[int]) -> None:
        self.shell = shell
        self.parser = parser
        self.channel = channel
        self.numbers = numbers
        self.session: Session | None = None

    @property
    def active(self) -> bool:
        return self.session is not None and self.session.active

    def command(self, words: list[str]) -> None:
        if not words:
            raise UsageError(f"%elastic session: start, stop or status?\n{USAGE}")
        action, rest = words[0], words[1:]
        if action == "start":
            self._start(rest)
        elif action == "stop":
            session, self.session = self.session, None
            if session is None:
                raise UsageError("%elastic session stop: no session is active.")
            session.stop()
            self.channel.wake()  # the panel shows it ended
            print(f"{session.run_id}: session ended; its workers have exited; %%elastic "
                  "cells are one-shot jobs again")
        elif action == "status":
            if self.session is None:
                print("no session in this kernel; start one with %elastic session start")
                return
            for key, value in self.session.status().items():
                print(f"{key:>10}: {value}")
            print_pool()
        else:
            raise UsageError(f"%elastic session {action}: unknown.\n{USAGE}")

    def _start(self, words: list[str]) -> None:
        if self.session is not None:
            raise UsageError("%elastic session start: a session is already active (or "
                             "ended without a stop); `%elastic session stop` ends it.")
        opts = parse_flags(self.parser, words, "%elastic session start")
        options = {k: v for k, v in vars(opts).items() if k in OPTION_NAMES}
        if options.get("pull"):
            raise UsageError("%elastic session start: --pull is for jobs; in a session, "
                             "`%elastic pull NAME` copies a variable when you want it.")
        try:
            self.session = Session(**options)
        except SpecError as exc:
            raise UsageError(f"%elastic session start: {exc}") from None
        self.channel.track_session(next(self.numbers), self.session,
                                          current_cell_id(self.shell))
        s = self.session.spec
        print(f"{self.session.run_id}: session of {s.nproc} workers; %%elastic cells now "
              f"run in it (--setup to replay a cell when it re-forms; up to "
              f"{s.max_restarts} re-formations)")
        command = self.session.wait_for_join_command(timeout=s.timeout)
        if command is not None:
            print(f"other machines join with: {command}")

    def run_cell(self, opts: Any, cell: str, view: Any) -> JobResult | None:
        """``%%elastic`` while the session is active: the cell runs on its ranks."""
        session = self.session
        assert session is not None
        result = None
        self.channel.wake()  # the panel shows the cell running
        try:
            result = session.run(cell, setup=opts.setup, render=view, check=False)
        except SessionEndedError as exc:
            raise UsageError(f"%%elastic: {exc} (`%elastic session stop` to run one-shot "
                             "jobs again)") from None
        except PayloadError as exc:
            raise UsageError(f"%%elastic: {exc}") from None
        finally:
            if opts.out and result is not None:
                self.shell.user_ns[opts.out] = result
        return cell_value(result)

    def check_cell(self, opts: Any, cell: str) -> None:
        """Before a session's cell runs: flags that only jobs take are an error, and so is
        a session that has ended (restarts spent) and was not stopped."""
        if not self.active:
            assert self.session is not None
            raise UsageError(f"%%elastic: {self.session.ended_error()} (`%elastic session "
                             "stop` to run one-shot jobs again)")
        given = sorted(k for k in vars(opts) if k in OPTION_NAMES)
        if given or opts.bg:
            flags = ", ".join(given + (["bg"] if opts.bg else []))
            raise UsageError(f"%%elastic: a session is active, and its cells take no job "
                             f"options ({flags}); `%elastic session stop` first to run a "
                             "job, or drop them.")
        require_plain_python(self.shell, cell)

    def scale(self, words: list[str]) -> None:
        assert self.session is not None
        if "--nodes" in words:  # a --launcher session: machines asked of the scheduler
            count = [w for w in words if w != "--nodes"]
            if not count or not count[0].isdigit():
                raise UsageError("%elastic scale --nodes: how many machines? For example "
                                 "`%elastic scale --nodes 3`.")
            try:
                self.session.scale_nodes(int(count[0]))
            except SpecError as exc:
                raise UsageError(f"%elastic {exc}") from None
            print(f"{self.session.run_id}: {count[0]} machines asked of its launcher")
            return
        # A session resizes between cells or at a commit: --now changes nothing.
        nproc, _, _, include = parse_scale(words)
        try:
            self.session.scale(nproc, include=include)
        except SpecError as exc:
            raise UsageError(f"%elastic {exc}") from None
        print(f"{self.session.run_id}: the session re-forms with {nproc} workers before "
              "the next cell (or at a State commit of the running one)")

    def print_stacks(self) -> None:
        assert self.session is not None
        try:
            stacks = self.session.stacks()
        except TimeoutError:
            raise UsageError("%elastic stacks: the session did not answer in time; try "
                             "again.") from None
        print_stacks(stacks)

    def controls(self) -> _CellControls:
        assert self.session is not None
        return _CellControls(self.session)

    def transfer(self, command: str, words: list[str]) -> Any:
        """%elastic push/pull/gather. pull and gather set the kernel's variables of those
        names and return what they set (one name: its value; several: a tuple), so that
        ``pids = %elastic gather pid`` is the dict by rank; push returns None."""
        if not self.active:
            raise UsageError(f"%elastic {command}: no session is active; "
                             "`%elastic session start` starts one.")
        session = self.session
        assert session is not None
        user_ns = self.shell.user_ns
        rank = 0
        if "--rank" in words:
            at = words.index("--rank")
            if at + 1 >= len(words) or not words[at + 1].isdigit():
                raise UsageError("%elastic pull: --rank takes a rank number.")
            rank = int(words[at + 1])
            words = words[:at] + words[at + 2:]
        if not words or not all(w.isidentifier() for w in words):
            raise UsageError(f"%elastic {command}: which variables?\n{USAGE}")
        try:
            if command == "push":
                missing = [w for w in words if w not in user_ns]
                if missing:
                    raise UsageError(f"%elastic push: no kernel variable named "
                                     f"{', '.join(missing)}.")
                session.push(**{w: user_ns[w] for w in words})
                return None
            if command == "pull":
                values = {w: session.pull(w, rank) for w in words}
            else:
                values = {w: session.gather(w) for w in words}
        except (PayloadError, NameError, ValueError) as exc:
            raise UsageError(f"%elastic {command}: {exc}") from None
        user_ns.update(values)
        return values[words[0]] if len(words) == 1 else tuple(values.values())
