"""The agent's decisions, without processes: what the loop does while a group runs, after it
ends, on resize requests, failing slots and when other machines wait; the environment a
left-out GPU gives the others; and the status board other threads read."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from elastic_magic.agent.node.environment import torchrun_env
from elastic_magic.agent.node.workers import Worker
from elastic_magic.agent.policy import (
    CellStatus,
    CellStep,
    FollowUp,
    GroupOutcome,
    GroupStatus,
    Membership,
    RegroupClock,
    Resize,
    after_group,
    blames_the_slot,
    cell_state,
    during_cell,
    during_group,
    final_state,
    own_failure,
    what_ended,
)
from elastic_magic.agent.round_info import RoundInfo
from elastic_magic.agent.status import StatusBoard
from elastic_magic.result import JobState, RankFailure
from elastic_magic.spec import JobSpec
from elastic_magic.ui.describe import describe
from elastic_magic.wire.events import WorkerFailed
from elastic_magic.wire.messages import Action

pytestmark = pytest.mark.unit

FAILED = GroupStatus(failed=True)
SUCCEEDED = GroupStatus(succeeded=True, running=True)
RESIZED = GroupStatus(resized=True)
BUSY = GroupStatus(running=True)


@pytest.mark.parametrize(("action", "regroup_due", "status", "step"), [
    (None, False, BUSY, GroupOutcome.WAIT),
    (None, False, GroupStatus(), GroupOutcome.WAIT),
    # a stop beats everything, a failure included: the user asked for it
    (Action.STOP, True, FAILED, GroupOutcome.STOP),
    (Action.STOP, False, SUCCEEDED, GroupOutcome.STOP),
    # membership changes come before the group's own state: a rank that fails because a
    # machine left is part of the regroup, not a failure
    (Action.REGROUP, False, FAILED, GroupOutcome.REGROUP),
    (None, True, FAILED, GroupOutcome.REGROUP),
    (Action.NODE_FAILED, False, BUSY, GroupOutcome.NODE_FAILED),
    # a machine that failed for good ends the job even while others wait to join
    (Action.NODE_FAILED, True, BUSY, GroupOutcome.NODE_FAILED),
    (None, False, FAILED, GroupOutcome.FAILED),
    # a failure and a success in the same poll: the failure decides
    (None, False, GroupStatus(failed=True, succeeded=True), GroupOutcome.FAILED),
    (None, False, SUCCEEDED, GroupOutcome.SUCCEEDED),
    (None, False, RESIZED, GroupOutcome.RESIZED),
])
def test_during_group(action, regroup_due, status, step):
    assert during_group(action, regroup_due, status) is step


@pytest.mark.parametrize(("step", "used", "allowed", "next_", "final"), [
    (GroupOutcome.FAILED, 0, 1, FollowUp.RESTART, JobState.FAILED),
    (GroupOutcome.FAILED, 1, 1, FollowUp.END, JobState.FAILED),
    (GroupOutcome.FAILED, 0, 0, FollowUp.END, JobState.FAILED),
    # membership changes never spend a restart, even with none left
    (GroupOutcome.REGROUP, 3, 3, FollowUp.NEW_ROUND, JobState.FAILED),
    (GroupOutcome.RESIZED, 0, 0, FollowUp.NEW_ROUND, JobState.FAILED),
    # another machine failed for good: the job ends whatever restarts are left here
    (GroupOutcome.NODE_FAILED, 0, 5, FollowUp.END, JobState.FAILED),
    (GroupOutcome.STOP, 0, 5, FollowUp.END, JobState.STOPPED),
    (GroupOutcome.SUCCEEDED, 0, 5, FollowUp.END, JobState.SUCCEEDED),
])
def test_after_group(step, used, allowed, next_, final):
    assert after_group(step, used, allowed) is next_
    if next_ is FollowUp.END:
        assert final_state(step) is final


@pytest.mark.parametrize(("step", "heard", "ended"), [
    (GroupOutcome.FAILED, None, GroupOutcome.FAILED),
    # a stop that arrived while the failed group was torn down: no restart, stopped
    (GroupOutcome.FAILED, Action.STOP, GroupOutcome.STOP),
    # another machine failed for good meanwhile: no restart here either
    (GroupOutcome.FAILED, Action.NODE_FAILED, GroupOutcome.NODE_FAILED),
    (GroupOutcome.REGROUP, Action.NODE_FAILED, GroupOutcome.NODE_FAILED),
    (GroupOutcome.RESIZED, Action.STOP, GroupOutcome.STOP),
    (GroupOutcome.SUCCEEDED, Action.STOP, GroupOutcome.SUCCEEDED),  # work done: a success stays one
    # a machine left or was lost while the group failed: its ranks lost peers, not a failure
    (GroupOutcome.FAILED, Action.REGROUP, GroupOutcome.REGROUP),
    (GroupOutcome.SUCCEEDED, Action.REGROUP, GroupOutcome.SUCCEEDED),
])
def test_what_arrives_during_a_teardown_outranks_a_restart(step, heard, ended):
    assert what_ended(step, heard) is ended


@pytest.mark.parametrize(("used", "allowed", "failed_before", "can_shrink", "next_"), [
    (0, 1, False, True, FollowUp.RESTART),  # a first failure with a restart left: restart
    (1, 2, True, True, FollowUp.EXCLUDE),  # the same slot failed again after a restart
    (1, 1, False, True, FollowUp.EXCLUDE),  # no restart left: go on smaller rather than fail
    (0, 0, False, True, FollowUp.EXCLUDE),
    (1, 2, True, False, FollowUp.RESTART),  # at --min-nproc already: restarts as before
    (1, 1, True, False, FollowUp.END),
])
def test_a_slot_that_fails_again_is_excluded_while_the_bounds_allow(
        used, allowed, failed_before, can_shrink, next_):
    assert after_group(GroupOutcome.FAILED, used, allowed, failed_before=failed_before,
                       can_shrink=can_shrink) is next_
    # only a failure of this machine's own group excludes one of its slots
    assert after_group(GroupOutcome.NODE_FAILED, used, allowed, failed_before=failed_before,
                       can_shrink=can_shrink) is FollowUp.END


@pytest.mark.parametrize(("failure", "blamed"), [
    (RankFailure(0, 0, 1, 9, 0.0, exit_code=-9, signal="SIGKILL"), True),
    (RankFailure(0, 0, 1, 9, 0.0, exit_code=3), True),
    (RankFailure(0, 0, 1, 9, 0.0, "AcceleratorError", "CUDA error: an illegal memory "
                 "access was encountered"), True),
    (RankFailure(0, 0, 1, 9, 0.0, "DistBackendError", "NCCL error in: ... unhandled "
                 "system error"), True),
    # the cell's own code: it would raise on any slot
    (RankFailure(0, 0, 1, 9, 0.0, "NameError", "name 'train' is not defined"), False),
    (RankFailure(0, 0, 1, 9, 0.0, "MisconfigurationException",
                 "`devices=2` does not match the world size (3)"), False),
    (RankFailure(0, 0, 1, 9, 0.0, "OutOfMemoryError", "CUDA out of memory."), False),
    (RankFailure(0, 0, 1, 9, 0.0, "AcceleratorError", "CUDA error: out of memory"), False),
    # a peer's death, as NCCL or gloo tell it: no evidence against this slot
    (RankFailure(0, 0, 1, 9, 0.0, "DistBackendError", "NCCL error: remote process exited "
                 "or there was a network error"), False),
    (RankFailure(0, 0, 1, 9, 0.0, reason="stalled for 60s"), False),
])
def test_only_a_death_or_a_device_error_blames_a_slot(failure, blamed):
    assert blames_the_slot(failure) is blamed


def test_slots_keep_their_identity_when_ranks_are_renumbered():
    m = Membership(nproc=3)
    assert m.slots == [0, 1, 2]
    assert not m.failed_before(1) and m.failed_before(1) and not m.failed_before(2)
    assert m.exclude(1) == (3, 2)
    assert m.slots == [0, 2]  # local ranks 0 and 1 run on slots 0 and 2
    assert m.resizes == 0  # not a resize the user asked for
    m.request(3, graceful=False)
    m.apply()
    assert m.slots == [0, 2, 3]  # growing again never brings the excluded slot back
    # unless the user names it back: a change even at the same size, and a fresh start
    assert m.request(3, graceful=True, include=[1, 7]) is Resize.AT_COMMIT
    assert m.resize_pending and m.slots == [0, 2, 3]  # the running group keeps its slots
    assert m.apply() == (3, 3) and m.slots == [0, 1, 2] and not m.failed_before(1)
    assert m.request(3, graceful=True, include=[1]) is Resize.NONE  # it is in already


def test_membership_resizes_at_a_commit_or_now_and_counts_only_real_changes():
    m = Membership(nproc=2)
    assert m.request(2, graceful=True) is Resize.NONE and not m.resize_pending
    assert m.request(3, graceful=True) is Resize.AT_COMMIT and m.resize_pending
    assert m.request(4, graceful=False) is Resize.NOW  # the latest request wins
    assert m.apply() == (2, 4) and m.nproc == 4 and m.resizes == 1
    assert m.apply() is None and m.resizes == 1  # nothing pending any more
    # asked to go back to the current size before the change applied: nothing changes
    m.request(1, graceful=True)
    m.request(4, graceful=True)
    assert not m.resize_pending and m.apply() is None and m.resizes == 1


def test_regroup_clock_waits_for_a_commit_only_when_graceful():
    clock = RegroupClock(check_interval=0.5, graceful_wait=10.0)
    assert clock.check_now(0.0)
    assert not clock.due(0.0, nodes_waiting=False, graceful=True)
    assert not clock.check_now(0.2)  # the rendezvous is asked at most every 0.5 s
    assert not clock.due(0.2, nodes_waiting=None, graceful=True)
    # a machine waits: a group with State gets 10 s to leave at its next commit
    assert not clock.due(1.0, nodes_waiting=True, graceful=True)
    assert not clock.due(5.0, nodes_waiting=True, graceful=True)
    assert clock.due(11.0, nodes_waiting=None, graceful=True)
    # the machine stopped waiting (it joined): the deadline is forgotten
    assert not clock.due(12.0, nodes_waiting=False, graceful=True)
    # without State there is nothing to wait for
    assert clock.due(13.0, nodes_waiting=True, graceful=False)
    clock.reset()  # a new group
    assert not clock.due(13.0, nodes_waiting=None, graceful=False)


def test_status_board_is_immutable_and_waits_without_polling():
    board = StatusBoard()
    first = board.current
    board.publish(state=JobState.RUNNING, pids={0: 11})
    assert first.state is JobState.RENDEZVOUS  # a snapshot never changes under a reader
    with pytest.raises(TypeError):
        board.current.pids[1] = 12  # type: ignore[index]

    def commit_later():
        board.publish(last_commit={"step": 3})

    threading.Timer(0.05, commit_later).start()
    status = board.wait_for(lambda s: s.last_commit is not None, timeout=10)
    assert status.last_commit == {"step": 3}
    # a waiter is released when the job is done, whatever it waited for
    threading.Timer(0.05, lambda: board.publish(done=True)).start()
    assert board.wait_for(lambda s: False, timeout=10).done


@pytest.mark.parametrize(("visible", "expected"), [
    (None, "0,2,3"),  # GPUs 0-3; slot 1 (GPU 1) left out
    ("4,5,6,7", "4,6,7"),  # the kernel saw GPUs 4-7 as 0-3
])
def test_a_left_out_gpu_is_hidden_so_local_rank_i_is_the_ith_visible_gpu(
        monkeypatch, tmp_path, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    spec = JobSpec.create(3, gpus=4, backend="gloo", log_dir=tmp_path)
    info = RoundInfo(1, "r", 0, 1, 0, 3, "127.0.0.1", 1)
    env = [torchrun_env(Worker(local_rank=i, global_rank=i, attempt=0), info, spec, nproc=3,
                        run_id="x", restart_count=1, error_file=tmp_path / "e",
                        slots=[0, 2, 3]) for i in range(3)]
    assert [e["ELASTIC_MAGIC_SLOT"] for e in env] == ["0", "2", "3"]
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1", "2"]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in env} == {expected}
    # nothing left out: the kernel's own setting, untouched
    full = torchrun_env(Worker(local_rank=1, global_rank=1, attempt=0), info, spec, nproc=3,
                        run_id="x", restart_count=0, error_file=tmp_path / "e")
    assert full["ELASTIC_MAGIC_SLOT"] == "1" and full.get("CUDA_VISIBLE_DEVICES") == visible


def test_the_slot_blamed_is_the_rank_that_failed_of_itself():
    def failure(rank, **kw):
        return RankFailure(rank=rank, local_rank=rank, attempt=0, pid=rank, time=rank, **kw)

    lagging = failure(0, reason="lagged behind: still busy outside any collective")
    lost_peer = failure(1, exc_type="RuntimeError", message="Connection closed by peer")
    exited = failure(2, exit_code=3)
    assert own_failure([lagging, lost_peer, exited]) is exited
    assert own_failure([lost_peer, lagging]) is lost_peer  # none of its own: the root cause
    assert own_failure([]) is None


def test_a_sessions_cell_ends_when_every_rank_answered_and_interrupts_the_rest():
    def step(action=None, interrupt=False, interrupted_for=None, **status):
        return during_cell(action, CellStatus(**status), interrupt=interrupt,
                           interrupted_for=interrupted_for, grace=5.0)

    assert step() is CellStep.WAIT
    assert step(reported=True) is CellStep.DONE
    assert step(reported=True, errors=True) is CellStep.DONE  # the ranks live on
    # one rank raised while others run (maybe waiting for it in a collective)
    assert step(errors=True) is CellStep.INTERRUPT
    assert step(interrupt=True) is CellStep.INTERRUPT  # Ctrl-C in the kernel
    assert step(errors=True, interrupted_for=1.0) is CellStep.WAIT
    assert step(errors=True, interrupted_for=5.0) is CellStep.BROKEN  # stuck: re-form
    assert step(interrupted_for=9.0, reported=True) is CellStep.DONE  # they came back
    assert step(died=True, reported=True) is CellStep.BROKEN  # a dead rank outranks answers
    assert step(resized=True) is CellStep.RESIZED
    assert step(stalled=True) is CellStep.BROKEN  # the watchdog named a rank: tear down
    assert step(Action.STOP, died=True) is CellStep.STOP
    # a resize waits for the cell's end (or its next commit): it does not break the cell
    assert step(Action.REGROUP) is CellStep.WAIT


def test_a_sessions_cell_succeeds_only_when_its_group_held():
    def failure(rank, **kw):
        return RankFailure(rank=rank, local_rank=rank, attempt=0, pid=rank, time=rank, **kw)

    def state(step, failures=(), interrupted=False, stuck=()):
        return cell_state(step, list(failures), interrupted=interrupted, stuck=stuck)

    ctrl_c = failure(0, exc_type="KeyboardInterrupt")
    raised = failure(0, exc_type="ValueError")
    died = failure(1, exit_code=0, reason="exited with code 0 in the middle of the cell")
    not_back = failure(1, reason="did not come back within 5s of the interrupt")
    waited = dataclasses.replace(not_back, consequence=True)
    assert state(CellStep.DONE) is JobState.SUCCEEDED
    assert state(CellStep.DONE, [raised]) is JobState.FAILED
    assert state(CellStep.DONE, [ctrl_c], interrupted=True) is JobState.STOPPED
    # a group that broke: never succeeded, whatever the ranks that answered said
    assert state(CellStep.BROKEN, [died]) is JobState.FAILED
    assert state(CellStep.BROKEN) is JobState.FAILED  # nothing known: still not a success
    # the user's interrupt, and a rank that did not come back from it
    assert state(CellStep.BROKEN, [not_back], True, (1,)) is JobState.STOPPED
    assert state(CellStep.BROKEN, [ctrl_c, not_back], True, (1,)) is JobState.STOPPED
    # a rank raised, the others were interrupted for it and one did not come back
    assert state(CellStep.BROKEN, [raised, waited], False, (1,)) is JobState.FAILED
    assert state(CellStep.BROKEN, [raised, waited], True, (1,)) is JobState.FAILED
    assert state(CellStep.STOP, [raised]) is JobState.STOPPED



def test_a_rank_that_lost_its_peer_is_told_as_stopped_not_as_a_failure():
    """A survivor reports gloo's error when its peer dies: the timeline said "rank 0
    failed: ... Connection reset by peer", as if rank 0 were a cause."""
    lost = RankFailure(0, 0, 1, 9, 0.0, "RuntimeError", "[gloo] Connection reset by peer")
    own = RankFailure(1, 1, 1, 9, 0.0, "ValueError", "bad batch")
    assert describe(WorkerFailed(lost)).text == \
        "rank 0 stopped: RuntimeError: [gloo] Connection reset by peer"
    assert describe(WorkerFailed(own)).text == "rank 1 failed: ValueError: bad batch"
