"""``elastic-magic``: take part in a notebook's elastic job from another machine.

    elastic-magic join HOST:PORT --token TOKEN [--nproc N|auto|cpu|gpu]

The cell that started the job (``%%elastic --nnodes 1:4 --rdzv-endpoint HOST:PORT``) prints
this command with its token. This machine's agent joins torch's rendezvous, runs the cell on
its workers, sends their output and results to the notebook, and follows the job through
restarts and resizes until the job ends or this command is interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from .checks import cuda_device_count, resolve_nproc
from .events import Event, JobState, Output, WorkerFailed
from .spec import JobSpec, SpecError

# A stop that reaches this machine comes from the head: the job is over, not failed here.
_EXIT_CODES = {JobState.SUCCEEDED: 0, JobState.FAILED: 1, JobState.STOPPED: 0}
_INTERRUPTED = 130
# What a node shows in the notebook: its ranks' lines and failures. Its own states,
# restarts and rounds stay on this terminal.
_FORWARDED = (Output, WorkerFailed)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-magic", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    join = commands.add_parser("join", help="run this machine's workers in a notebook's job")
    join.add_argument("endpoint", help="HOST:PORT the cell printed (its --rdzv-endpoint)")
    join.add_argument("--token", default=os.environ.get("ELASTIC_MAGIC_TOKEN"),
                      help="the job's token, as printed by the cell (or ELASTIC_MAGIC_TOKEN)")
    join.add_argument("--nproc", default=None,
                      help="workers on this machine: N, auto, cpu or gpu (default: one per "
                           "GPU, or 1)")
    join.add_argument("--host", default=None,
                      help="this machine's address as the others reach it (default: the "
                           "address it reaches the notebook from)")
    join.add_argument("--log-dir", default=None, help="where this machine keeps rank logs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.token:
        print("elastic-magic join: --token is required; copy the join command the cell "
              "printed.", file=sys.stderr)
        return 2
    if not args.endpoint.rpartition(":")[2].isdigit():
        print(f"elastic-magic join: {args.endpoint!r} is not HOST:PORT.", file=sys.stderr)
        return 2
    try:
        nproc = resolve_nproc(args.nproc, cuda_device_count())
    except SpecError as exc:
        print(f"elastic-magic join: {exc}", file=sys.stderr)
        return 2
    return _join(args, nproc)


def _join(args: argparse.Namespace, nproc: int) -> int:
    from .agent.hub import HubError, connect
    from .agent.job import Job
    from .agent.roles import JoinedJob
    from .messages import Forward, Hello
    from .ui.text import TextRenderer

    try:
        link, offer = connect(args.endpoint, args.token)
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

    def forward(event: Event) -> None:
        if isinstance(event, _FORWARDED):
            link.send(Forward(event))

    # The job's agent owns the link from here: it reads it and closes it at the end.
    job = Job(spec, payload, offer.run_id, joined=JoinedJob(link, args.endpoint, host),
              forward=forward)
    link.send(Hello(host, nproc))
    print(f"[elastic] joined job {job.run_id} at {args.endpoint} with {nproc} workers; "
          f"logs: {job.log_dir}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's SIGTERM: leave cleanly
    job.start()
    try:
        result = job.wait(TextRenderer())
    except KeyboardInterrupt:
        return _INTERRUPTED
    return _EXIT_CODES.get(result.state, 1)


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
