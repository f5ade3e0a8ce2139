"""Worker entrypoint: a fresh interpreter that runs payloads until told to exit.

argv: CONTROL_FD REPORT_FD NOTICE_FD PARENT_PID. The process the agent spawns forks at
once and stays behind as the rank's shepherd (``shepherd.py``): it ends everything the
worker starts, and tells the agent how the worker ended on the notice pipe. The agent
first writes the job's secret on the control pipe, then signed messages
(``wire/messages.py``): Run, Reply or Exit. The control pipe is also a lifeline: EOF without an
Exit means the kernel is gone, and the worker ends its whole process group at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

from elastic_magic.wire.messages import DumpStacks, Exit, Interrupt, Reply, Run
from elastic_magic.wire.protocol import KEY_BYTES, Channel, ProtocolError
from elastic_magic.worker import client as agent_client
from elastic_magic.worker import group_store, leave, shepherd
from elastic_magic.worker import session_cells as session
from elastic_magic.worker.progress import answer_stacks, report_progress
from elastic_magic.worker.runner import run_payload, shutdown_process_group
from elastic_magic.worker.stdout import NONCE_BYTES, buffer_stdout

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when our shepherd exits (it outlives us unless killed)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def accept_signals(shepherd_pid: int) -> None:
    """Take SIGINT and SIGTERM again: the agent spawns us with both blocked, so that a
    Ctrl-C meant for the kernel cannot reach us before we leave its process group (the
    shepherd dropped any such one; a forked child starts with none pending). On a joined
    machine SIGTERM stays blocked in every thread: one thread takes it, and ends the rank
    only on one from the agent, the shepherd or the rank itself
    (``shepherd.TERM_FROM_VARIABLE``)."""
    agent = shepherd.term_sender()
    # Their actions are ours, not those inherited through exec: a kernel or joining agent
    # started in the background (``cmd &``) ignores SIGINT, one leaving at a commit ignores
    # SIGTERM; its ranks could then be neither interrupted nor asked to leave.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK,
                           {signal.SIGINT} if agent else {signal.SIGINT, signal.SIGTERM})
    if agent:
        threading.Thread(target=_take_sigterm, args=({agent, shepherd_pid, os.getpid()},),
                         name="elastic-sigterm", daemon=True).start()


def _take_sigterm(senders: set[int]) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid not in senders:
        pass  # the scheduler's: this machine's agent has it too, and leaves at a commit
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.raise_signal(signal.SIGTERM)  # its default action: the rank ends as asked


def read_secret(fd: int, size: int) -> bytes:
    key = b""
    while len(key) < size:
        chunk = os.read(fd, size - len(key))
        if not chunk:
            os._exit(1)
        key += chunk
    return key


def _to_null(*fds: int) -> None:
    """Point ``fds`` at /dev/null (not closed: their numbers must not be reused for a file
    that stray writes to the old channel would then reach)."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in fds:
        os.dup2(null, fd, inheritable=False)
    os.close(null)


def main() -> None:
    control_fd, report_fd, notice_fd, parent_pid = (int(a) for a in sys.argv[1:5])
    serve(control_fd, report_fd, notice_fd, parent_pid)


def serve(control_fd: int, report_fd: int, notice_fd: int, parent_pid: int) -> None:
    """Be a rank: fork the shepherd (it keeps the notice pipe), then run payloads until
    Exit. Also the entry of a worker forked by the zygote (``zygote.py``), whose parent is
    the zygote."""
    shepherd_pid = shepherd.start(parent_pid, close_in_shepherd=(control_fd, report_fd),
                                  notice=notice_fd)
    serve_rank(control_fd, report_fd, shepherd_pid)


def serve_rank(control_fd: int, report_fd: int, shepherd_pid: int) -> None:
    """Run payloads until Exit, below a shepherd already there (a spare's: ``spares.py``)."""
    accept_signals(shepherd_pid)
    die_with_parent(shepherd_pid)
    key = read_secret(control_fd, KEY_BYTES)
    nonce = read_secret(control_fd, NONCE_BYTES).hex()  # of the order marks: not the user's
    # A process the cell forks (a DataLoader's workers) must not hold our pipes: the agent
    # learns of this rank's death from the report pipe's end, which would wait for them.
    os.register_at_fork(after_in_child=lambda: _to_null(control_fd, report_fd))
    control, report = Channel(control_fd, key), Channel(report_fd, key)
    client = agent_client.AgentClient(report)
    agent_client.install(client)
    exiting = threading.Event()

    def listen() -> None:
        while True:
            try:
                message = control.recv()
            except EOFError:
                if not exiting.is_set():  # lifeline lost: the kernel is gone
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                return
            except ProtocolError as exc:  # nothing more from the agent can be read
                print(f"[elastic] worker: control pipe failed: {exc}", file=sys.stderr,
                      flush=True)
                os.killpg(os.getpgrp(), signal.SIGKILL)
                return
            match message:
                case Reply():
                    client.deliver(message)
                case Exit():
                    exiting.set()
                    leave.receive(message)
                case Run():
                    leave.receive(message)
                case DumpStacks(request_id):
                    answer_stacks(client, request_id)
                case Interrupt(group_ends):  # a session's cell, or a survivor's payload
                    leave.ask()  # noted first: a cell that begins after it sees it
                    session.interrupt_main()
                    if group_ends:  # after the signal: the wait's error raises it
                        group_store.leave_store()

    threading.Thread(target=listen, name="elastic-lifeline", daemon=True).start()
    buffer_stdout(nonce)
    report_progress(client)
    while isinstance(message := leave.next_message(), Run):
        if message.env:  # a survivor's new group: its ranks, size and store
            with contextlib.suppress(Exception):  # a session's rank still holds the old one
                shutdown_process_group()
            os.environ.update(message.env)
            if message.payload.session:
                roll_back_session_states()
        # exits the process itself when it fails, unless it stays (survivors stay)
        run_payload(message.payload, client, stay=message.stay)
    shutdown_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def roll_back_session_states() -> None:
    """A session's survivor meets the new ranks at the last commit: its States go back
    to it, and the cell's output says so where one had gone further."""
    from elastic_magic.training.state import roll_back_kept_states

    rank = os.environ.get("RANK", "?")
    try:
        moved = roll_back_kept_states()
    except Exception as exc:  # the cell goes on; the new ranks hold the last commit
        print(f"[elastic] rank {rank}: its State could not go back to the last commit "
              f"({type(exc).__name__}: {exc}); it may be ahead of the new ranks",
              file=sys.stderr, flush=True)
        return
    if moved is not None and moved[0] != moved[1]:
        print(f"[elastic] rank {rank}: State back at the last commit (step {moved[1]}) from "
              f"step {moved[0]}, as every rank of the re-formed group", file=sys.stderr,
              flush=True)


if __name__ == "__main__":
    main()
