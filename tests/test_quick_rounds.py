"""torch's rendezvous polls, as ``agent/machines/quick_rounds.py`` paces them: fast while the state
changes, backing off to a quarter second while it does not, torch's own pace outside an
operation. (The multi-node tests run these polls for real; this checks the pacing.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from elastic_magic.agent.machines import quick_rounds

pytestmark = pytest.mark.unit


def _state(participants=("a",), round_=1):
    return SimpleNamespace(round=round_, complete=False, closed=False, deadline=None,
                           participants=dict.fromkeys(participants, 0), wait_list=set())


def test_polls_back_off_while_nothing_changes_and_start_over_when_something_does(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(quick_rounds.time, "sleep", slept.append)
    assert dynamic_rendezvous._delay is quick_rounds._delay  # installed on import
    executor = SimpleNamespace(_state=_state())
    seen: list[list[float]] = []

    def handler(ctx_executor):
        for _ in range(7):
            dynamic_rendezvous._delay(seconds=1)  # torch's SYNC poll
        seen.append(list(slept))
        slept.clear()
        ctx_executor._state = _state(("a", "b"))  # a machine joined
        dynamic_rendezvous._delay(seconds=1)
        dynamic_rendezvous._delay(seconds=1)

    monkeypatch.setattr(quick_rounds, "_torch_run", lambda self, *a, **k: handler(self))
    quick_rounds._run(executor)
    assert seen[0] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.25]
    assert slept == [0.01, 0.02]
    # outside an operation, and the first round's jitter: torch's pace, and no sleep
    torch_slept: list[float] = []
    monkeypatch.setattr(quick_rounds, "_torch_delay", torch_slept.append)
    dynamic_rendezvous._delay(seconds=1)
    dynamic_rendezvous._delay(seconds=(0, 0.3))
    assert torch_slept == [1]




def test_a_machine_that_may_close_a_round_polls_every_50_ms_in_its_last_call(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(quick_rounds.time, "sleep", slept.append)
    state = _state(("head", "other"))
    state.deadline = "the last call runs"
    executor = SimpleNamespace(_state=state)
    operations: list[object] = []

    def handler(ctx_executor, operation):
        operations.append(operation)
        for _ in range(6):
            dynamic_rendezvous._delay(seconds=1)

    monkeypatch.setattr(quick_rounds, "_torch_run", handler)
    join, leave = dynamic_rendezvous._RendezvousJoinOp(), dynamic_rendezvous._RendezvousExitOp()
    with quick_rounds.closing(lambda joined: False):
        quick_rounds._run(executor, join)
        assert slept == [0.01, 0.02, 0.04, 0.05, 0.05, 0.05]
        quick_rounds._run(executor, leave)
    assert operations[0] is not join and operations[1] is leave  # only a join closes rounds
    # Outside the block (a machine that does not close rounds): a quarter second, torch's join.
    slept.clear()
    quick_rounds._run(executor, join)
    assert slept == [0.01, 0.02, 0.04, 0.08, 0.16, 0.25] and operations[2] is join
