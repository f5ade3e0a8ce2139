"""Spare ranks: processes the zygote forks ahead, each as far as a rank gets before it has
a job (its own session, its seeds, its shepherd forked), waiting for one. Handing a spare
its job (the descriptors and environment of a fork request) is one message; forking a rank
on request is the zygote's fork, the child's set-up and the shepherd's fork, about 40 ms
on two busy cores: most of what a replaced rank waits for before its cell runs.

The zygote keeps as many as it was last asked for (the ranks a job runs on this machine),
and forks them between requests (``Spares.refill_after``): a refill is two forks of a
process with torch loaded and the shepherd's interpreter starting, 30-40 ms of CPU, which
would slow the group a spare has just joined on a machine whose cores its ranks keep busy.
A spare's worker is named ``em-spare`` until it has a job; its shepherd is an
``em-shepherd``, as every rank's. A spare ends with its zygote (its shepherd's
PR_SET_PDEATHSIG); one that died idle is reaped and passed over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any, NoReturn

from . import forked, shepherd

NAME = b"em-spare"
MAX_SPARES = 8  # a machine's GPUs: beyond, idle processes cost more than they save


class Spares:
    """The zygote's spares, oldest first, and how many it keeps."""

    # Once the spares ran out (a group started), the zygote refills them all after
    # REFILL_SOON without a request: the burst is served first, and the next cell or
    # failure finds its spares. With some left (a rank replaced, a rank added), after
    # REFILL_QUIET: the group a spare has just joined is not slowed by the forks.
    REFILL_SOON = 0.02
    REFILL_QUIET = 0.5

    def __init__(self, agent: socket.socket) -> None:
        self.agent = agent  # the zygote's socket: no spare may hold it
        self.wanted = 0
        self._idle: list[tuple[int, socket.socket]] = []  # (shepherd PID, our end)
        self._ran_out = False  # refilling after the spares ran out: soon, until full

    def want(self, count: int) -> None:
        """Keep ``count`` from now on (the idle ones beyond it end now)."""
        self.wanted = max(0, min(int(count), MAX_SPARES))
        while len(self._idle) > self.wanted:
            self._end(*self._idle.pop())

    def short(self) -> bool:
        return len(self._idle) < self.wanted

    def refill_after(self) -> float | None:
        """How long to wait for a request before forking one more (None: enough)."""
        if not self.short():
            self._ran_out = False
            return None
        self._ran_out |= not self._idle
        return self.REFILL_SOON if self._ran_out else self.REFILL_QUIET

    @property
    def sockets(self) -> list[socket.socket]:
        """Our ends of the idle spares': one readable is a spare that died (they never
        write), to be reaped (``drop_dead``)."""
        return [sock for _pid, sock in self._idle]

    def add(self) -> None:
        """Fork one more; the child becomes the spare and never returns. Should that fail
        (descriptors or processes at their limit), no more are forked until a request
        asks again: a spare is never worth the zygote, and the ranks it serves."""
        zygote = os.getpid()
        pair: tuple[socket.socket, ...] = ()
        try:
            pair = ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
        except OSError:
            for sock in pair:
                sock.close()
            self.wanted = len(self._idle)
            return
        if pid:
            theirs.close()
            self._idle.append((pid, ours))
            return
        ours.close()
        self.close_in_child()
        forked.crash_on_error(lambda: _become_spare(theirs, zygote))

    def drop_dead(self, readable: list[socket.socket]) -> None:
        """Reap the spares whose end is ``readable``: they died idle."""
        for pid, sock in [spare for spare in self._idle if spare[1] in readable]:
            self._idle.remove((pid, sock))
            self._end(pid, sock)

    def end_all(self) -> None:
        """End and reap every idle spare (the zygote is going)."""
        self.want(0)

    @staticmethod
    def _end(pid: int, sock: socket.socket) -> None:
        sock.close()  # EOF: it ends if it still waits
        with contextlib.suppress(ProcessLookupError):  # ours, not reaped: its PID
            os.kill(pid, shepherd.END_ALL)
        os.waitpid(pid, 0)

    def hand_out(self, fds: list[int], request: dict[str, Any]) -> int | None:
        """Give the oldest live spare this job (what a fork request carries); its
        shepherd's PID, or None when there is none to give."""
        env = request["env"]
        if env.get(shepherd.TERM_FROM_VARIABLE) != os.environ.get(shepherd.TERM_FROM_VARIABLE):
            return None  # its shepherd, forked already, reads this from the zygote's
        job = json.dumps({"env": env, "cwd": request["cwd"]}).encode()
        while self._idle:
            pid, sock = self._idle.pop(0)
            try:
                socket.send_fds(sock, [job], fds)
            except OSError:  # it died idle
                self._end(pid, sock)
                continue
            sock.close()
            return pid
        return None

    def close_in_child(self) -> None:
        """In any child the zygote forks: the agent's socket and the spares' are not its."""
        self.agent.close()
        for _pid, sock in self._idle:
            sock.close()


def _become_spare(own: socket.socket, zygote: int) -> NoReturn:
    forked.detach({own.fileno()}, None, None, NAME)
    forked.reseed()
    from .__main__ import die_with_parent, serve_rank

    # The rank's notice pipe comes with its job: handed on to the shepherd through this.
    handover, shepherds = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    shepherd_pid = shepherd.start(zygote, close_in_shepherd=(own.fileno(), handover.fileno()),
                                  notice_from=shepherds.detach())
    die_with_parent(shepherd_pid)
    data, fds, _flags, _addr = socket.recv_fds(own, forked.MAX_MESSAGE, forked.WORKER_FDS)
    if not data or len(fds) != forked.WORKER_FDS:  # the zygote is gone
        os._exit(0)
    own.close()
    shepherd.discard_interrupts()  # any sent while it waited: a forked rank has none
    control, report, out, err, notice = fds
    socket.send_fds(handover, [b"n"], [notice])
    handover.close()
    os.close(notice)
    for source, target in ((out, 1), (err, 2)):
        os.dup2(source, target)
        os.close(source)
    forked.set_name(forked.WORKER_NAME)
    job = json.loads(data)
    forked.take_job(job["env"], job["cwd"])
    forked.run_rank(lambda: serve_rank(control, report, shepherd_pid))

