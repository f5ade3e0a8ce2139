"""``%%elastic`` runs a cell as a job; ``%elastic`` manages jobs (jobs, status, stop, logs)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..agent.handles import attached, detached_launch
from ..agent.handles.ended import EndedJob
from ..agent.handles.handle import next_batch
from ..agent.handles.job import Job, Renderer
from ..folders import NotPrivate
from ..result import JobResult
from ..spec import OPTION_NAMES, JobSpec, SpecError, flag_arguments
from ..ui.text import TextRenderer
from ..wire.events import JobState
from ..wire.payload import Payload, PayloadError, build_payload
from .comm import JobsChannel, current_cell_id
from .job_commands import USAGE as JOB_USAGE
from .job_commands import JobCommands
from .magic_cells import (
    cell_value,
    finish_view,
    forget_pool,
    magic_words,
    make_view,
    parse_flags,
    require_plain_python,
)
from .session_magic import USAGE as SESSION_USAGE
from .session_magic import SessionCommands

_SUBCOMMANDS = f"""{JOB_USAGE}
Sessions (workers that live across cells; see %%elastic?):
{SESSION_USAGE}"""

# The magic's own flags: how a job is shown, not what it runs (those come from JobSpec).
_VIEW_FLAGS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("-o", "--out"), dict(default=None, metavar="NAME",
                           help="store the JobResult in this kernel variable (also on "
                                "failure); with --bg, the Job handle")),
    (("--bg",), dict(action="store_true",
                     help="run in the background and return a Job handle at once; "
                          "see %%elastic jobs/status/stop/logs")),
    (("--text",), dict(action="store_true",
                       help="plain-text output even where widgets render (no dashboard)")),
    (("--setup",), dict(action="store_true",
                        help="in a session: record this cell; it is replayed, in order, "
                             "whenever the session re-forms")),
]


def _with_flags(magic: Callable[..., Any]) -> Callable[..., Any]:
    """``@magic_arguments`` with an ``@argument`` per job option, then the view flags:
    the parser and the ``%%elastic?`` help are built from JobSpec's option table."""
    for names, kwargs in reversed([*flag_arguments(), *_VIEW_FLAGS]):
        magic = argument(*names, **kwargs)(magic)  # decorators apply bottom-up
    return magic_arguments()(magic)


@magics_class
class ElasticMagics(Magics):
    """The ``%%elastic`` and ``%elastic`` magics, one per kernel (registered when the
    extension loads): the jobs and sessions its cells started, and the lab panel's channel."""

    shell: Any  # set once registered (IPython types it Optional)

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        numbers = itertools.count(1)  # jobs and sessions, as the panel lists them
        self.channel = JobsChannel()  # the JupyterLab extension's "Elastic jobs" panel
        self.channel.open(shell)
        self.sessions = SessionCommands(shell, self.elastic.parser,  # type: ignore[attr-defined]
                                        self.channel, numbers)
        self.job_commands = JobCommands(self.channel, numbers, self.sessions)

    @property
    def jobs(self) -> dict[int, Job | EndedJob]:
        return self.job_commands.jobs

    @_with_flags
    @cell_magic
    def elastic(self, line: str, cell: str) -> Any:
        """Run the cell as an elastic distributed PyTorch job on local worker processes.

        Each worker is a fresh Python interpreter with torchrun's environment (RANK,
        LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...); the process group is made when the
        cell first uses it, unless the cell calls init_process_group itself (or --no-init).
        Kernel variables the cell reads are sent to every worker. In a notebook a live
        dashboard shows the job (state, world size, restarts, every rank's output, a Stop
        button) and leaves a static record when the cell ends; elsewhere each rank's
        output appears with a [rank N] prefix. The cell's last
        expression is each rank's value (JobResult.values). A failed rank stops the whole
        group at once; with --max-restarts the group starts again.

        Resizing: start with --min-nproc/--max-nproc, then `%elastic scale N` (or the
        dashboard's Resize). A cell that keeps an elastic_magic.State resizes at its next
        state.commit() and resumes from it (`%elastic scale N --now` applies it at once,
        from the last commit); a cell without State restarts at the new size. A resize is
        a membership change: it does not count as a restart.

        Several machines: `--nnodes 1:4 --rdzv-endpoint 10.0.0.5:29400` prints
        `elastic-magic join 10.0.0.5:29400 --token-file PATH`; run it on each other machine
        (the token is in a file only you can read, off the command line, where `ps` shows
        it to everyone; where the file is not shared, copy it, or set ELASTIC_MAGIC_TOKEN
        to `job.token` and leave --token-file out). A machine that joins or leaves, or a
        resize here, makes every machine re-rendezvous (torch's waiting-node mechanism);
        their ranks' output shows here.

        Sessions: `%elastic session start --nproc 2 [job flags]` starts workers that stay
        alive; while it is active, each %%elastic cell (no job flags) runs on every rank in
        that rank's persistent namespace, so what one cell defines the next one sees. A rank
        that raises reports it and the session goes on; Ctrl-C interrupts every rank's code.
        Cells marked --setup are replayed, in order, when the session re-forms: after a rank
        dies (or does not come back from an interrupt within 5 s), up to --max-restarts
        times (default 3 for sessions), and on `%elastic scale N` (before the next cell, or
        at a State commit of the running cell). Kernel variables travel only when asked:
        `%elastic push NAME`, `%elastic pull NAME [--rank R]`, `%elastic gather NAME`.
        With --nnodes, joined machines run every cell too, and a machine that joins or
        leaves re-forms the session at the next cell. `%elastic session stop` (or the
        kernel ending) ends it. In Python: elastic_magic.Session(nproc=2).

        Example::

            %%elastic --nproc 2 --max-restarts 1 -o job
            import torch, torch.distributed as dist
            t = torch.ones(1) * dist.get_rank()
            dist.all_reduce(t)
            t.item()
        """
        opts = parse_flags(self.elastic.parser, line,  # type: ignore[attr-defined]
                           f"%%elastic {line}")
        if self.sessions.session is not None:  # active, or ended and not yet stopped
            return self._session_cell(opts, cell)
        if opts.setup:
            raise UsageError("%%elastic --setup: no session is active; `%elastic session "
                             "start` starts one.")
        spec = self._spec(opts)
        job = self._job(spec, cell, f"%%elastic {line}".strip())
        view: Renderer | None = None
        try:  # from here on, an interrupt or error anywhere must not orphan the job
            job.start()
            if opts.bg:
                return self._follow_in_background(job, opts.text, opts.out)
            view = self._show(job, opts.text, background=False)
            result = job.wait(view)
        except KeyboardInterrupt as exc:
            job.end("interrupted")  # a detached job: this kernel detaches, the job runs on
            finish_view(view)  # the record of what ran
            # Shown without the library's frames: nothing in them is the user's.
            exc._render_traceback_ = lambda: [  # type: ignore[attr-defined]
                f"KeyboardInterrupt: {job.interrupt_note}"]
            raise
        except BaseException:
            job.end("interrupted")
            finish_view(view)  # the record of what ran
            raise
        finally:
            # On interrupt too: the result if there is one.
            if opts.out and not opts.bg and job.result is not None:
                self.shell.user_ns[opts.out] = job.result
        finish_view(view)
        shown = self._live(view) or (isinstance(view, TextRenderer) and view.printed(result))
        return self._deliver(result, shown=bool(shown))

    @line_magic("elastic")  # type: ignore[arg-type]  # IPython mistypes line_magic(name)
    def elastic_command(self, line: str) -> Any:
        """Manage elastic jobs of this kernel.

        %elastic jobs | status [JOB] | stop [JOB] | scale N [JOB] [--now] [--include S,...]
        %elastic attach [RUN_ID] [-o NAME] [--text]  (a --detach job, from any kernel)
        %elastic logs RANK [JOB] [-n N] [--stderr] | stacks [JOB] | pool forget
        %elastic session start [flags] | stop | status; push|pull|gather NAME
        """
        words = magic_words(line, "%elastic", job_refs=True)
        if not words or words[0] not in ("jobs", "status", "stop", "scale", "logs", "stacks",
                                         "session", "push", "pull", "gather", "pool", "attach"):
            raise UsageError(f"%elastic: expected a subcommand:\n{_SUBCOMMANDS}")
        command, rest = words[0], words[1:]
        jobs = self.job_commands
        if command == "attach":
            return self._attach(rest)
        if command == "session":
            self.sessions.command(rest)
        elif command in ("push", "pull", "gather"):  # IPython returns a line magic's value
            return self.sessions.transfer(command, rest)
        elif command == "scale" and self.sessions.active:
            self.sessions.scale(rest)
        elif command == "stacks" and self.sessions.active and not rest:
            self.sessions.print_stacks()
        elif command == "pool":
            forget_pool(rest)
        elif command == "jobs":
            jobs.print_jobs()
        elif command == "status":
            jobs.print_status(rest)
        elif command == "stop":
            jobs.stop(rest)
        elif command == "scale":
            jobs.scale(rest)
        elif command == "stacks":
            jobs.print_stacks(rest)
        else:
            jobs.print_logs(rest)

    # -- %%elastic helpers ---------------------------------------------------------------

    def _spec(self, opts: Any) -> JobSpec:
        if opts.out is not None and not opts.out.isidentifier():
            raise UsageError(f"-o/--out {opts.out!r}: not a Python variable name.")
        # Flags left out are absent from opts: JobSpec fills in the defaults.
        options = {k: v for k, v in vars(opts).items() if k in OPTION_NAMES}
        try:
            return JobSpec.create(**options)
        except SpecError as exc:
            raise UsageError(f"%%elastic: {exc}") from None

    def _job(self, spec: JobSpec, cell: str, title: str) -> Job:
        """The cell's job, not started (a detached one is). Its payload is no local of the
        cell magic's frame: a failure's traceback, which IPython keeps, would keep it (a
        cell's variables, 50 MB of them say) alive until the next error."""
        payload = self._payload(cell, spec)
        if spec.detach:
            return detached_launch.start(spec, payload, title=title)
        return Job(spec, payload)

    def _payload(self, cell: str, spec: JobSpec) -> Payload:
        require_plain_python(self.shell, cell)
        try:
            return build_payload(cell, spec, namespace=self.shell.user_ns)
        except PayloadError as exc:
            raise UsageError(f"%%elastic: {exc}") from None

    def _session_cell(self, opts: Any, cell: str) -> JobResult | None:
        self.sessions.check_cell(opts, cell)
        view = make_view(self.shell, self.sessions.controls(), opts.text)
        try:
            return self.sessions.run_cell(opts, cell, view)
        finally:
            finish_view(view)

    @staticmethod
    def _live(view: Renderer | None) -> bool:
        """The live dashboard (then its record) is the cell's output."""
        return view is not None and not isinstance(view, TextRenderer)

    def _show(self, job: Job, text: bool, *, background: bool) -> Renderer:
        """The job among the kernel's (``%elastic`` and the panel list it), and its view."""
        number = self.job_commands.remember(job)
        view = make_view(self.shell, job, text)
        self.channel.track(number, job, current_cell_id(self.shell), background,
                           view=getattr(view, "panel_view", None))
        return view

    def _follow_in_background(self, job: Job, text: bool, out: str | None, *,
                              story: bool = False) -> Job | None:
        view = self._show(job, text, background=True)
        if story:  # an attached job's events so far: shown in this cell, before it returns
            view(next_batch(job.events, wait=False))
        if out:
            self.shell.user_ns[out] = job
        threading.Thread(target=self._follow, args=(job, view), daemon=True,
                         name=f"elastic-view-{job.run_id}").start()
        # Where the live dashboard shows the job, a returned handle would print once and
        # go stale ("rendezvous"): -o NAME and %elastic reach it.
        return None if self._live(view) else job

    def _attach(self, words: list[str]) -> Job | None:
        """``%elastic attach [RUN_ID] [-o NAME] [--text]``: follow a detached job here."""
        out = words[words.index("-o") + 1] if "-o" in words[:-1] else None
        names = [w for w in words if w not in ("-o", "--text", out)]
        if len(names) > 1 or words[-1:] == ["-o"] or (out is not None
                                                       and not out.isidentifier()):
            raise UsageError("usage: %elastic attach [RUN_ID] [-o NAME] [--text] (NAME: a "
                             "Python variable name)")
        try:
            job = attached.attach(names[0] if names else None)
        except (attached.DetachedError, NotPrivate) as exc:
            raise UsageError(f"%elastic attach: {exc}") from None
        return self._follow_in_background(job, "--text" in words, out, story=True)

    def _follow(self, job: Job, view: Renderer) -> None:
        """Background jobs: keep the view fed until the job ends, then pull variables."""
        try:
            result = job.wait(view)
        except attached.DetachedError:  # this kernel let a detached job go: it runs on
            return
        finally:
            finish_view(view)
        if result.ok:
            self.shell.user_ns.update(result.pulled)

    def _deliver(self, result: JobResult, shown: bool = False) -> JobResult | None:
        if result.state is not JobState.FAILED:
            self.shell.user_ns.update(result.pulled)
            if result.missing_pulls:
                raise UsageError(
                    f"--pull: rank 0 has no variable named {', '.join(result.missing_pulls)} "
                    "after the cell ran; the job itself succeeded."
                )
        return cell_value(result, shown=shown)

    def stop_all(self) -> None:
        """End every job of this kernel that still runs (the extension is unloaded); a
        detached job only loses its follower here, and the next one's agent exits."""
        self.job_commands.end_all("the extension was unloaded")
        detached_launch.drop_standby()
        if self.sessions.session is not None:
            self.sessions.session.stop()
        self.channel.close()
