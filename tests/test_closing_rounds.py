"""A rendezvous round closes as soon as every machine linked to the head has joined it, not
when torch's last call ends (``agent/machines/quick_rounds.py``); the last call stays for
machines the head does not know yet.

Every test sets a last call of 30 s where the round must not wait for it, and bounds the
wait well below it: a round can only close by its last call 30 s after its first machine
joined, which is after the test started it (or after the event that calls for the round),
so the bound cannot be met by waiting the last call out, however loaded the machine is.

The first tests run torch's real rendezvous (TCPStore, c10d backend, signed state) with
every machine in this process, told apart by address (127.0.0.x); the last runs a real
job with an ``elastic-magic join`` process.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from test_elastic import STEPS, TRAIN, assert_same_parameters, committed_steps
from test_elastic import baseline as baseline  # the module-scoped fixture
from test_lost_machines import _training_shared
from test_multinode import machines as machines  # the fixture
from test_multinode import run_head
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

import elastic_magic as em
from elastic_magic import torch_internals
from elastic_magic.agent.machines import quick_rounds
from elastic_magic.agent.machines.rendezvous import Rendezvous
from elastic_magic.agent.round_info import RoundInfo
from elastic_magic.wire.events import RendezvousCompleted
from elastic_magic.wire.protocol import new_secret

pytestmark = pytest.mark.cluster

LAST_CALL = 30.0
WITHIN = 20.0  # a round that closed on its own: well before its last call could end


class Cluster:
    """One head (127.0.0.1) and machines that join it (127.0.0.2, ...), all in this process;
    each joins rounds on a thread of its own."""

    def __init__(self, expected: Callable[[], set[tuple[str, int]] | None],
                 last_call: float = LAST_CALL) -> None:
        self.key = new_secret()
        self.last_call = last_call
        self.head = self._rendezvous("127.0.0.1", None)
        self.head.close_rounds_when_joined(expected)
        self.all = [self.head]

    def _rendezvous(self, host: str, join: str | None) -> Rendezvous:
        return Rendezvous("closing-rounds", key=self.key, host=host, join=join, min_nodes=1,
                          max_nodes=4, join_timeout=60, last_call_timeout=self.last_call)

    def add(self, host: str) -> Rendezvous:
        machine = self._rendezvous(host, self.head.endpoint)
        self.all.append(machine)
        return machine

    def close(self) -> None:
        for machine in reversed(self.all):
            machine.close(shutdown=machine is self.head)


class Joining:
    """``rendezvous.next_round(1)`` on a thread: its RoundInfo, or what it raised."""

    def __init__(self, rendezvous: Rendezvous) -> None:
        self.info: RoundInfo | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._join, args=(rendezvous,), daemon=True)
        self._thread.start()

    def _join(self, rendezvous: Rendezvous) -> None:
        try:
            self.info = rendezvous.next_round(1)
        except BaseException as exc:
            self.error = exc

    def result(self, within: float = WITHIN) -> RoundInfo:
        self._thread.join(timeout=within)
        assert not self._thread.is_alive(), f"the round did not close within {within:g}s"
        assert self.error is None and self.info is not None, self.error
        return self.info


def me(host: str) -> tuple[str, int]:
    return host, os.getpid()


def test_torchs_join_closes_the_round_when_ready_says_so_and_only_in_its_last_call():
    """The join operation, alone: what torch's executor would do next."""
    settings = dr.RendezvousSettings("r", 2, 4, dr.RendezvousTimeout(), timedelta(seconds=5), 3)
    head, other, third = (dr._NodeDesc(f"127.0.0.{n}", 100 + n, 0) for n in (1, 2, 3))
    now = datetime.now(UTC)
    state = dr._RendezvousState()
    state.participants, state.last_heartbeats = {head: 0}, {head: now, other: now}
    answers: list[set[tuple[str, int]]] = []

    def ready(joined: set[tuple[str, int]]) -> bool:
        answers.append(joined)
        return ("127.0.0.3", 103) in joined

    join = torch_internals.completing_join(
        dr._RendezvousJoinOp(), lambda ctx: quick_rounds._may_close(ready, ctx))
    ctx, later = dr._RendezvousContext(head, state, settings), time.monotonic() + 60
    assert join(ctx, later) is dr._Action.SYNC and answers == []  # below MIN: torch waits
    state.participants[other] = 0
    state.deadline = now + timedelta(seconds=30)  # MIN joined: the last call runs
    assert join(ctx, later) is dr._Action.SYNC  # a machine expected is missing
    assert answers == [{("127.0.0.1", 101), ("127.0.0.2", 102)}]
    state.participants[third], state.last_heartbeats[third] = 0, now
    assert join(ctx, later) is dr._Action.MARK_RENDEZVOUS_COMPLETE
    state.complete = True
    assert join(ctx, later) is dr._Action.FINISH and len(answers) == 2
    # A node that is not in the round (it waits for the next one) never closes it.
    state.complete = False
    outside = dr._RendezvousContext(dr._NodeDesc("127.0.0.4", 104, 0), state, settings)
    assert join(outside, later) is dr._Action.ADD_TO_PARTICIPANTS and len(answers) == 2


def test_a_round_closes_once_every_linked_machine_has_joined():
    expected: set[tuple[str, int]] = set()
    cluster = Cluster(lambda: expected)
    try:
        # Alone and linked to nobody: the first round closes at once.
        assert Joining(cluster.head).result().nnodes == 1
        # A machine linked to the head joins: it waits, and the head regroups with it.
        expected.add(me("127.0.0.2"))
        second = Joining(cluster.add("127.0.0.2"))
        deadline = time.monotonic() + WITHIN
        while cluster.head.num_nodes_waiting() == 0:
            assert time.monotonic() < deadline, "the machine never waited for a round"
            time.sleep(0.01)
        head = Joining(cluster.head)
        assert (head.result().nnodes, second.result().nnodes) == (2, 2)
        assert head.result().node_rank == 0 and second.result().world_size == 2
    finally:
        cluster.close()


def test_a_linked_machine_not_joined_yet_holds_the_round_until_it_joins():
    asked = threading.Event()

    def expected() -> set[tuple[str, int]]:
        asked.set()  # asked only while the round's last call runs
        return {me("127.0.0.2"), me("127.0.0.3")}

    cluster = Cluster(expected)
    try:
        head, second = Joining(cluster.head), Joining(cluster.add("127.0.0.2"))
        assert asked.wait(WITHIN)
        time.sleep(0.3)  # several polls: the round must not close without 127.0.0.3
        third = Joining(cluster.add("127.0.0.3"))
        assert [j.result().nnodes for j in (head, second, third)] == [3, 3, 3]
    finally:
        cluster.close()


def test_a_machine_the_head_does_not_know_yet_waits_for_the_last_call():
    """None: a link has not said who it is; torch's last call decides (here 1.5 s)."""
    cluster = Cluster(lambda: None, last_call=1.5)
    try:
        started = time.monotonic()
        head, second = Joining(cluster.head), Joining(cluster.add("127.0.0.2"))
        assert (head.result().nnodes, second.result().nnodes) == (2, 2)
        assert time.monotonic() - started >= 1.5  # the deadline is torch's, a lower bound
    finally:
        cluster.close()


def test_a_machine_that_comes_after_the_round_closed_joins_the_next_one():
    """The head closed a round without a machine it did not know of (it linked while the
    round was being closed): that machine waits for the next round, which has it."""
    expected = {me("127.0.0.2")}
    cluster = Cluster(lambda: expected)
    try:
        head, second = Joining(cluster.head), Joining(cluster.add("127.0.0.2"))
        assert (head.result().nnodes, second.result().nnodes) == (2, 2)
        late = cluster.add("127.0.0.3")
        third = Joining(late)
        deadline = time.monotonic() + WITHIN
        while cluster.head.num_nodes_waiting() == 0:  # it waits: torch's scale-up signal
            assert time.monotonic() < deadline, "the late machine never waited for a round"
            time.sleep(0.01)
        # who waits, as the head tells a machine it let in from one it sent away
        assert cluster.head.waiting_agents() == {me("127.0.0.3")}
        expected.add(me("127.0.0.3"))  # its Hello arrived meanwhile
        rejoined = [Joining(cluster.head), Joining(cluster.all[1])]
        assert [j.result().nnodes for j in (*rejoined, third)] == [3, 3, 3]
    finally:
        cluster.close()


def test_a_job_regroups_at_a_join_and_a_loss_without_waiting_out_the_last_call(
        baseline, machines, log_dir, recorder):
    """A real job, room for a third machine, a 30 s last call: the first round (the head
    alone), the round with a machine that joins, and the round after that machine's agent
    is SIGKILLed each close as soon as the machines linked to the head are in; no step is
    lost or run twice."""
    spec = em.JobSpec.create(1, nnodes="1:3", last_call=LAST_CALL, log_dir=log_dir,
                             timeout=120, link_timeout=3)
    calls: dict[str, float] = {"start": time.time()}  # when each round was called for

    def drive(job):
        job.wait_for_commit(3, timeout=120)
        calls["join"] = time.time()
        machines.join(1)
        if not _training_shared(job, recorder):
            return
        calls["loss"] = time.time()
        machines.procs[0].send_signal(signal.SIGKILL)  # ours, by PID

    result = run_head(spec, TRAIN, recorder, machines, namespace={"KILL_AT": -1, "PAUSE": 0.4},
                      drive=drive)
    assert result.ok, result
    assert machines.procs[0].wait(timeout=60) == -signal.SIGKILL
    rounds = recorder.of(RendezvousCompleted)
    assert [r.world_size for r in rounds] == [1, 2, 1], rounds
    for called, closed in zip(("start", "join", "loss"), rounds, strict=True):
        assert closed.time - calls[called] < WITHIN, (called, closed.time - calls[called])
    assert result.restarts == 0
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)
