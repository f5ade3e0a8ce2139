"""``elastic-magic``: take part in a notebook's elastic job from another machine.

    elastic-magic join HOST:PORT --token-file PATH [--nproc N|auto|cpu|gpu]
    ELASTIC_MAGIC_TOKEN=TOKEN elastic-magic join HOST:PORT
    elastic-magic join HOST:PORT --token-stdin        (a launcher's: see below)
    elastic-magic join HOST:PORT                      (asks for the token)

The cell that started the job (``%%elastic --nnodes 1:4 --rdzv-endpoint HOST:PORT``) prints
the first form: its token is in a file only you can read (under ~/.cache/elastic_magic/tokens,
which a cluster's machines usually share; elsewhere copy it over, or give its content as
ELASTIC_MAGIC_TOKEN). The notebook never shows the token, and it never goes on the command
line, where every user of this machine could read it (ps). This machine's agent joins torch's
rendezvous, runs the cell on its workers, sends their output and results to the notebook,
and follows the job through restarts and resizes until the job ends or this command is
interrupted. If the head is lost (its link closes, or carries no heartbeat for the job's
--link-timeout), the workers are stopped and the command exits with status 1, saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import getpass
import os
import signal
import stat
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .checks import cuda_device_count, resolve_nproc
from .spec import JobSpec, SpecError
from .wire.events import Event, JobState, NetworkChosen, Output, WorkerFailed
from .wire.metrics import Logged

# A stop that reaches this machine comes from the head: the job is over, not failed here.
_EXIT_CODES = {JobState.SUCCEEDED: 0, JobState.FAILED: 1, JobState.STOPPED: 0}
_INTERRUPTED = 130
# What a node shows in the notebook: its ranks' lines, failures and logged scalars, and the
# network its workers use. Its own states, restarts and rounds stay on this terminal.
_FORWARDED = (Output, WorkerFailed, NetworkChosen, Logged)
TOKEN_VARIABLE = "ELASTIC_MAGIC_TOKEN"
ALLOCATION_VARIABLE = "ELASTIC_MAGIC_ALLOCATION"  # set by a launcher (ssh); Slurm's job id


_HELP = (__doc__ or "").replace("``", "")


class UsageError(Exception):
    """A mistake in how the command was run; the message says what to do."""


def _parser() -> argparse.ArgumentParser:
    # The module's docstring is the help, less its reStructuredText quoting.
    parser = argparse.ArgumentParser(prog="elastic-magic", description=_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    join = commands.add_parser(
        "join", help="run this machine's workers in a notebook's job",
        description="Run this machine's workers in the job of the notebook whose cell "
                    "printed ENDPOINT, until that job ends or this command is interrupted "
                    "(SIGINT: at once; SIGTERM, as schedulers send it: at the job's next "
                    "State commit; the job regroups without this machine).",
        epilog=f"The token is never an argument: set {TOKEN_VARIABLE} in this command's "
               "environment (a batch script's export, a Kubernetes Secret) or use "
               "--token-file. The workers reach the other machines through the interface "
               "that carries this machine's address (--host); GLOO_SOCKET_IFNAME or "
               "NCCL_SOCKET_IFNAME in this command's environment choose another. Slurm and "
               "Kubernetes: see examples/slurm and examples/kubernetes in the repository.")
    join.add_argument("endpoint", help="HOST:PORT the cell printed (its --rdzv-endpoint)")
    join.add_argument("--token-file", type=Path, default=None,
                      help=f"a file holding the job's token, readable by you only (chmod "
                           f"600); without it the token comes from {TOKEN_VARIABLE}, or is "
                           "asked for")
    join.add_argument("--token-stdin", action="store_true",
                      help="the token is the first line on stdin, and the end of stdin "
                           "afterwards stops this machine as SIGTERM does (a launcher's "
                           "ssh session: when it closes, this machine leaves the job)")
    # Refused with an explanation: a token in argv is visible to every user (ps).
    join.add_argument("--token", help=argparse.SUPPRESS)
    join.add_argument("--nproc", default=None,
                      help="workers on this machine: N, auto, cpu or gpu (default: one per "
                           "GPU, or 1)")
    join.add_argument("--host", default=None,
                      help="this machine's address as the others reach it (default: the "
                           "address it reaches the notebook from); its interface carries "
                           "the workers' traffic")
    join.add_argument("--log-dir", default=None, help="where this machine keeps rank logs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if not args.endpoint.rpartition(":")[2].isdigit():
            raise UsageError(f"{args.endpoint!r} is not HOST:PORT.")
        nproc = resolve_nproc(args.nproc, cuda_device_count())
        token = read_token(args)
    except (UsageError, SpecError) as exc:
        print(f"elastic-magic join: {exc}", file=sys.stderr)
        return 2
    return _join(args, nproc, token)


def read_token(args: argparse.Namespace) -> str:
    """The job's token from --token-file, the environment or a prompt; never from argv."""
    if args.token is not None:
        raise UsageError(
            "--token is not accepted: a token on the command line is visible to every user "
            f"of this machine (ps). Run the command the notebook printed (elastic-magic "
            f"join {args.endpoint} --token-file PATH), or set {TOKEN_VARIABLE}.")
    if args.token_stdin:
        token = sys.stdin.readline()
    elif args.token_file is not None:
        token = _token_from_file(args.token_file)
    elif os.environ.get(TOKEN_VARIABLE):
        token = os.environ[TOKEN_VARIABLE]
    elif sys.stdin.isatty():
        try:
            token = getpass.getpass("job token (`job.token` in the notebook): ")
        except EOFError:
            token = ""
    else:
        raise UsageError(
            "no token: run the command the notebook printed (elastic-magic join HOST:PORT "
            f"--token-file PATH), or set {TOKEN_VARIABLE} to the job's token.")
    # This machine's workers (and the cell they run) need not inherit it.
    os.environ.pop(TOKEN_VARIABLE, None)
    token = token.strip()
    if not token:
        raise UsageError("the token is empty: `job.token` in the notebook holds it.")
    return token


def _token_from_file(path: Path) -> str:
    try:
        with path.open() as file:
            info = os.fstat(file.fileno())
            if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise UsageError(f"{path} can be read by other users; the token must be "
                                 f"yours alone: chmod 600 {path}")
            if info.st_uid != os.geteuid():  # someone else's file, planted where you look
                raise UsageError(f"{path} belongs to user id {info.st_uid}, not to you: "
                                 "use a token file of your own")
            return file.read()
    except OSError as exc:
        raise UsageError(f"cannot read the token file: {exc}") from None


def _join(args: argparse.Namespace, nproc: int, token: str) -> int:
    from .agent.handles.job import AgentError, Job
    from .agent.machines.hub import HubError, connect
    from .agent.machines.joined import JoinedJob
    from .agent.machines.rendezvous import rendezvous_key
    from .agent.node.environment import inherited_env
    from .agent.node.pool import prewarm
    from .ui.text import TextRenderer
    from .wire.link_messages import Hello, RankEvents
    from .worker.shepherd import TERM_FROM_VARIABLE

    if args.token_stdin:  # the launcher's end (its ssh session closed): leave the job
        threading.Thread(target=_leave_at_end_of_stdin, daemon=True,
                         name="elastic-stdin-lifeline").start()
    try:
        link, offer = connect(args.endpoint, token)
    except (HubError, OSError) as exc:
        print(f"elastic-magic join: {exc}", file=sys.stderr)
        return 1
    host = args.host or link.sock.getsockname()[0]
    try:
        spec = JobSpec.for_machine(offer.spec, nproc=nproc, gpus=cuda_device_count(),
                                   log_dir=args.log_dir)
    except SpecError as exc:
        print(f"elastic-magic join: {exc}", file=sys.stderr)
        link.close()
        return 2
    # The cell runs in this machine's working directory, with this interpreter's path.
    cwd = os.getcwd()
    payload = dataclasses.replace(offer.payload, cwd=cwd,
                                  sys_path=[cwd, *(p for p in sys.path if p)])
    if not payload.session:  # SIGTERM is ours to act on (below), not our ranks'
        os.environ[TERM_FROM_VARIABLE] = str(os.getpid())
    if spec.pool:  # its zygote imports torch while this machine joins the next round
        prewarm({**inherited_env(nproc), **spec.env}, cwd, payload.sys_path, spec.preload)

    def forward(event: Event) -> None:
        if isinstance(event, _FORWARDED):
            link.send(RankEvents(event))

    joined = JoinedJob(link, args.endpoint, host, rendezvous_key(token))
    if payload.session:  # the head runs a session: cells come one by one, until it ends
        return _join_session(spec, payload, offer.run_id, joined, forward, host, nproc)

    # The job's agent owns the link from here: it reads it and closes it at the end.
    job = Job(spec, payload, offer.run_id, joined=joined, forward=forward)
    link.send(Hello(host, nproc, os.getpid(), _allocation()))
    print(f"[elastic] joined job {job.run_id} at {args.endpoint} with {nproc} workers; "
          f"logs: {job.log_dir}", flush=True)
    # A scheduler's SIGTERM (a preemption or a cancel, with a grace time): this machine
    # leaves at the job's next commit.
    terminated: list[bool] = []  # as before leaving at a commit: it was interrupted (130)
    signal.signal(signal.SIGTERM,
                  lambda signum, frame: _leave_at_commit(link, terminated))
    job.start()
    try:
        result = job.wait(TextRenderer())
    except KeyboardInterrupt:
        return _INTERRUPTED
    except AgentError as exc:  # its workers are stopped; say why, without a traceback
        print(f"elastic-magic join: {exc.__cause__ or exc}", file=sys.stderr)
        return 1
    if result.failure is not None:  # the head lost, say, or this machine's root cause
        print(f"elastic-magic join: {result.failure.headline}", file=sys.stderr)
    if terminated and result.state is JobState.STOPPED:
        return _INTERRUPTED
    return _EXIT_CODES.get(result.state, 1)


def _join_session(spec: JobSpec, payload: Any, run_id: str, joined: Any,
                  forward: Any, host: str, nproc: int) -> int:
    from .agent.loop.assemble import join_session
    from .wire.link_messages import Hello

    joined.link.send(Hello(host, nproc, os.getpid(), _allocation()))
    print(f"[elastic] joined session {run_id} with {nproc} workers; logs: "
          f"{spec.log_dir / run_id}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's SIGTERM: leave cleanly
    try:
        state = join_session(spec, payload, run_id, joined, forward)
    except KeyboardInterrupt:
        return _INTERRUPTED
    return _EXIT_CODES.get(state, 1)


def _allocation() -> str:
    """The launcher's allocation this machine runs in, so the head can give it back."""
    return os.environ.get(ALLOCATION_VARIABLE) or os.environ.get("SLURM_JOB_ID", "")


def _leave_at_commit(link: Any, terminated: list[bool]) -> None:
    from .wire.link_messages import LeaveAtCommit

    terminated.append(True)
    # Slurm signals the task and srun forwards the same SIGTERM: once is enough. Its
    # SIGKILL after the grace time, or Ctrl-C (SIGINT) here, ends this machine at once.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("[elastic] SIGTERM: leaving the job at its next commit", flush=True)
    link.send(LeaveAtCommit("its scheduler sent SIGTERM (preempted or cancelled)"))


def _leave_at_end_of_stdin() -> None:
    """Read stdin to its end, then stop this machine as a scheduler's SIGTERM does."""
    with contextlib.suppress(OSError, ValueError):
        while os.read(sys.stdin.fileno(), 4096):
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def entry() -> None:
    """The console script: once the job is over and every worker reaped, leave without
    interpreter finalisation, which can abort ("terminate called without an active
    exception") while torch's store threads are still being torn down."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
