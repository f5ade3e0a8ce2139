"""Survivors stay, inside the cell (``elastic_magic.run``): a survivor leaves the failed
group where the error reached it, waits there for the next group and goes on in the same
frame, with every object the cell made before the call, instead of running the cell again
from the top.

The agent sees what it sees of any survivor: Parked, then (given the next group's Run)
Running; the payload's Result comes when the cell ends. Where the survivor cannot go on
in place (its rank changed, its State is sharded, the job ends), the message is put back
and :class:`~elastic_magic.worker.leave.RerunCell` unwinds the cell: the worker's loop
then runs the cell from the top, or exits, as after any parked payload.
"""

from __future__ import annotations

import os
import time

from elastic_magic.wire.messages import Resized, Run, Running
from elastic_magic.worker import client as agent_client
from elastic_magic.worker import default_group, leave, progress
from elastic_magic.worker.client import ResizeExit
from elastic_magic.worker.runner import leave_group, report_parked, why_parked


def rejoin(exc: BaseException, *, in_place: bool) -> bool:
    """After ``exc`` in the function of ``elastic_magic.run`` (or in its rollback and
    ``on_reset`` callbacks, going on in place): True once this rank is in
    the next group, in place (the caller then calls :func:`leave.resume`, which raises for
    an Interrupt that came for this group already, and the rank parks again); False when
    it does not stay (no job, no ``--survivors``, a session's cell, a user's interrupt):
    the caller raises ``exc``. ``in_place``: the caller can go on in place (else it is
    told to run the cell again)."""
    running, report = leave.running_payload(), agent_client.current()
    if running is None or report is None or isinstance(exc, leave.RerunCell):
        return False
    payload, stay = running
    if not stay or payload.session or why_parked(exc) is None:
        return False
    leave.pause()
    if isinstance(exc, ResizeExit):
        report.send(Resized(exc.step, time.time()))
    report_parked(report, exc)
    leave_group(exc)
    del exc
    message = leave.next_message()
    env = message.env if isinstance(message, Run) and message.env else {}
    if not (in_place and isinstance(message, Run)
            and env.get("RANK", os.environ.get("RANK")) == os.environ.get("RANK")):
        leave.put_back(message)  # the worker's loop takes it once the cell has unwound
        raise leave.RerunCell
    os.environ.update(env)
    default_group.keep_destroyed_groups()
    if message.payload.init_process_group:  # made where the function first uses it
        default_group.arm(message.payload.backend, message.payload.timeout)
    leave.running(message.payload, message.stay)
    progress.running.set()
    report.send(Running(time.time(), os.getpid()))
    return True
