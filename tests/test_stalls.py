"""Naming the rank a hang is about, without processes: where a stack says a rank is, the
watchdog's and the timeout's decisions, and how consequences are told apart and described."""

from __future__ import annotations

import gc
import traceback
import weakref
from pathlib import Path

import pytest

from elastic_magic.agent.diagnosis.stalls import (
    HangDiagnosis,
    HangKind,
    RankView,
    cause_reason,
    judge_failure,
    judge_stall,
    odd_one_out,
    quiet_ranks,
)
from elastic_magic.result import (
    JobResult,
    JobState,
    RankFailure,
    describe_failure,
    is_consequence,
    root_cause_order,
)
from elastic_magic.stacks import (
    Frame,
    RankActivity,
    RankPosition,
    RankStacks,
    ThreadStack,
    drop_locals,
    place_of,
)

pytestmark = pytest.mark.unit

TORCH = "/venv/lib/python3.11/site-packages/torch"
ALL_REDUCE = (
    Frame("<cell>", 7, "<module>", "dist.all_reduce(t)"),
    Frame(f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper", "return func(*args, **kwargs)"),
    Frame(f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce", "work.wait()"),
)
SLEEPING = (Frame("<cell>", 6, "<module>", "time.sleep(60)"),)
COMPUTING = (
    Frame("<cell>", 9, "<module>", "y = model(x)"),
    Frame(f"{TORCH}/nn/modules/linear.py", 125, "forward", "return F.linear(x, w, b)"),
)


def stacks(rank: int, frames: tuple[Frame, ...], *others: ThreadStack) -> RankStacks:
    return RankStacks(rank, (ThreadStack("MainThread", True, frames), *others))


# -- where a rank is ----------------------------------------------------------------------


def test_a_main_thread_inside_torch_distributed_waits_in_a_collective():
    place = place_of(stacks(0, ALL_REDUCE))
    assert place == RankPosition(RankActivity.COLLECTIVE, "all_reduce", 7, "dist.all_reduce(t)")
    assert place.describe() == "waiting in a collective (all_reduce at cell line 7)"


def test_sleeping_computing_or_silent_ranks_are_outside_a_collective():
    assert place_of(stacks(1, SLEEPING)) == RankPosition(RankActivity.OUTSIDE, "", 6,
                                                         "time.sleep(60)")
    assert place_of(stacks(1, COMPUTING)).where is RankActivity.OUTSIDE  # in torch, not distributed
    assert place_of(RankStacks(1, note="did not answer")).where is RankActivity.SILENT


def test_only_the_main_thread_decides_and_user_code_between_ends_the_search():
    # another thread in a collective does not make the rank wait in one
    helper = ThreadStack("loader", False, ALL_REDUCE)
    assert place_of(stacks(0, SLEEPING, helper)).where is RankActivity.OUTSIDE
    # torch.distributed called from user code that then calls torch compute: not waiting
    frames = (*ALL_REDUCE[:1], Frame(f"{TORCH}/distributed/utils.py", 1, "helper", ""),
              Frame("/home/me/mine.py", 3, "hook", ""), *COMPUTING[1:])
    assert place_of(stacks(0, frames)).where is RankActivity.OUTSIDE


def test_stack_text_shows_cell_lines_and_threads():
    text = stacks(0, ALL_REDUCE, ThreadStack("loader", False, SLEEPING)).format()
    assert text.startswith("Thread MainThread (main), most recent call last:\n"
                           "  Cell line 7, in <module>\n    dist.all_reduce(t)\n")
    assert 'distributed_c10d.py", line 3252, in all_reduce' in text
    assert "Thread loader, most recent call last:\n  Cell line 6" in text
    assert RankStacks(3, note="finished").format() == "finished"


class _Model:
    """Stands for what a failed frame holds: a model, a DDP reducer, an agent's stores."""


def _fails_holding(model: _Model, error: BaseException, cause: BaseException | None = None):
    if cause is None:
        raise error
    raise error from cause


def test_an_errors_frames_and_those_of_every_error_it_chains_to_let_go_of_their_variables():
    # what a survivor drops before the next group: the collective's error, raised from the
    # peer's loss while the user's code handled an error of its own (a cause and a context
    # that differ: a walk along one of them misses the other)
    held = {name: _Model() for name in ("raised", "cause", "context")}
    refs = {name: weakref.ref(model) for name, model in held.items()}
    try:
        _fails_holding(held.pop("cause"), OSError("peer gone"))
    except OSError as exc:
        cause = exc
    try:
        _fails_holding(held.pop("context"), KeyError("the user's own"))
    except KeyError:
        try:
            _fails_holding(held.pop("raised"), RuntimeError("the collective failed"), cause)
        except RuntimeError as exc:
            error = exc
    del cause
    text = "".join(traceback.format_exception(error))
    assert isinstance(error.__cause__, OSError) and isinstance(error.__context__, KeyError)
    gc.collect()
    assert all(ref() is not None for ref in refs.values())  # the frames hold them

    drop_locals(error)
    gc.collect()
    assert [name for name, ref in refs.items() if ref() is not None] == []
    assert "".join(traceback.format_exception(error)) == text  # still printable
    drop_locals(None)


# -- the watchdog -------------------------------------------------------------------------

WAITING = RankPosition(RankActivity.COLLECTIVE, "all_reduce", 7)
BARRIER = RankPosition(RankActivity.COLLECTIVE, "barrier", 4)
ASLEEP = RankPosition(RankActivity.OUTSIDE, "", 6)
SILENT = RankPosition(RankActivity.SILENT)


def test_nothing_to_judge_while_every_rank_makes_progress():
    views = [RankView(0, 0.4), RankView(1, 1.2)]
    assert quiet_ranks(views, 3) == ()
    assert judge_stall(views, 3, 3).kind is HangKind.NONE


def test_a_quiet_rank_outside_a_collective_stalled_and_the_waiting_ones_are_consequences():
    views = [RankView(0, 3.5, place=WAITING), RankView(1, 4.0, place=ASLEEP),
             RankView(2, 0.2, place=WAITING)]
    assert quiet_ranks(views, 3) == (0, 1)
    verdict = judge_stall(views, 3, 3)
    assert verdict == HangDiagnosis(HangKind.STALLED, (1,), (0, 2))
    assert cause_reason(verdict, views[1]) == ("stalled: no progress for 4s, outside any "
                                               "collective, while ranks 0, 2 waited in one")


def test_of_several_stalled_ranks_the_one_quiet_longest_comes_first():
    views = [RankView(0, 5, place=ASLEEP), RankView(1, 9, place=SILENT),
             RankView(2, 6, place=WAITING)]
    verdict = judge_stall(views, 3, 3)
    assert verdict.causes == (1, 0) and verdict.waiting == (2,)
    assert "no answer when asked for its stack" in cause_reason(verdict, views[1])


def test_a_rank_waiting_for_a_busy_peer_is_left_alone():
    views = [RankView(0, 8, place=WAITING), RankView(1, 0.5, place=ASLEEP)]
    assert judge_stall(views, 3, 3).kind is HangKind.NONE


def test_a_rank_that_returned_while_others_wait_left_early():
    views = [RankView(0, 4, place=WAITING), RankView(1, 4, finished=True)]
    verdict = judge_stall(views, 3, 3)
    assert verdict == HangDiagnosis(HangKind.LEFT_EARLY, (1,), (0,))
    assert cause_reason(verdict, views[1]) == ("returned early: its cell finished while "
                                               "rank 0 waited in a collective")


def test_every_rank_in_a_collective_names_the_odd_one_out():
    views = [RankView(0, 4, place=WAITING), RankView(1, 4, place=BARRIER),
             RankView(2, 4, place=WAITING)]
    verdict = judge_stall(views, 3, 3)
    assert verdict == HangDiagnosis(HangKind.ALL_WAITING, (1,), (0, 2))
    places = {v.rank: v.place for v in views if v.place}
    assert cause_reason(verdict, views[1], places) == (
        "called a different collective: barrier, while ranks 0, 2 wait in all_reduce")


def test_every_rank_in_the_same_collective_is_a_lost_peer_or_a_mismatch():
    views = [RankView(0, 4, place=WAITING), RankView(1, 5, place=WAITING)]
    # on several machines the ranks waited for may be busy elsewhere: no verdict here
    assert judge_stall(views, 3, all_waiting_after=float("inf")).kind is HangKind.NONE
    verdict = judge_stall(views, 3, all_waiting_after=3)
    assert verdict == HangDiagnosis(HangKind.ALL_WAITING, (1,), (0,))
    assert cause_reason(verdict, views[1], {0: WAITING, 1: WAITING}).startswith(
        "waited with every rank: all_reduce for 5s")
    assert odd_one_out(views) == (1,)


def test_after_a_timeout_the_rank_that_never_reached_the_collective_is_the_cause():
    # rank 0 reported the timeout and is gone; rank 1 was still busy (not even quiet)
    verdict = judge_failure([RankView(1, 0.3, place=ASLEEP)], timed_out=(0,))
    assert verdict == HangDiagnosis(HangKind.STALLED, (1,), (0,))
    assert cause_reason(verdict, RankView(1, 0.3, place=ASLEEP)).startswith("lagged behind")
    left = judge_failure([RankView(1, 9, finished=True)], timed_out=(0,))
    assert left == HangDiagnosis(HangKind.LEFT_EARLY, (1,), (0,))
    # everyone alive waits in a collective: nothing more to say than the timeout itself
    assert judge_failure([RankView(1, 9, place=WAITING)], timed_out=(0,)).kind is HangKind.NONE


# -- consequences in the result -----------------------------------------------------------

GLOO_TIMEOUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed "
                "out waiting 5000ms for recv operation to complete")
PEER_LOSS = ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:27307. "
             "This is typically caused by a remote worker crashing.")


def failure(rank, when, **kwargs):
    return RankFailure(rank=rank, local_rank=rank, attempt=0, pid=100 + rank, time=when,
                       **kwargs)


@pytest.mark.parametrize("message", [GLOO_TIMEOUT, PEER_LOSS,
                                     "Watchdog caught collective operation timeout: "
                                     "WorkNCCL(SeqNum=3, OpType=ALLREDUCE)"])
def test_timeouts_and_lost_peers_are_consequences(message):
    assert is_consequence(failure(0, 1.0, exc_type="RuntimeError", message=message))
    assert not is_consequence(failure(0, 1.0, exc_type="ValueError", message="boom"))
    # a timeout of the user's own, outside torch.distributed, is a cause like any error
    assert not is_consequence(failure(0, 1.0, exc_type="TimeoutError", traceback="Cell line 3",
                                      message="the data server timed out"))
    assert not is_consequence(failure(0, 1.0, signal="SIGKILL"))
    assert is_consequence(failure(0, 1.0, reason="waited in barrier", consequence=True))


def result_of(failures):
    return JobResult(run_id="em-x", state=JobState.FAILED, world_size=2, restarts=0,
                     max_restarts=0, duration=1.0, log_dir=Path("/l"), failure=failures[0],
                     failures=failures)


def test_a_killed_ranks_consequence_is_one_line_without_traceback():
    peer = failure(0, 10.0, exc_type="RuntimeError", message=PEER_LOSS,
                   traceback="Traceback (most recent call last):\n  ...\nRuntimeError: x\n")
    killed = failure(1, 10.4, signal="SIGKILL", exit_code=-9)
    ordered = root_cause_order([peer, killed])
    text = describe_failure(result_of(ordered))
    assert text.startswith("Rank 1 failed first") and "killed by SIGKILL" in text
    assert ("  rank 0: Connection closed by peer [127.0.0.1]:27307. This is typically caused "
            "by a remote worker crashing. (after rank 1 was killed by SIGKILL)") in text
    assert "Traceback" not in text and "also failed" not in text


def test_a_stalled_root_keeps_its_stack_and_the_waiting_rank_is_a_consequence():
    stalled = failure(1, 5.0, reason="stalled: no progress for 4s, outside any collective",
                      traceback="Thread MainThread (main), most recent call last:\n"
                                "  Cell line 6, in <module>\n    time.sleep(60)",
                      cell_line=6, source_line="time.sleep(60)")
    waiting = failure(0, 4.0, reason="waited in all_reduce", consequence=True, cell_line=7)
    timed_out = failure(2, 9.0, exc_type="RuntimeError", message=GLOO_TIMEOUT)
    result = result_of([stalled, timed_out, waiting])
    result.stacks = {1: "...", 0: "..."}
    text = describe_failure(result)
    assert text.startswith("Rank 1 failed first (attempt 1 of 1, restarts used 0/0): stalled: "
                           "no progress for 4s, outside any collective (cell line 6)")
    assert "    cell line 6: time.sleep(60)" in text and "Cell line 6, in <module>" in text
    assert "  rank 0: waited in all_reduce at cell line 7 (after rank 1 stalled)" in text
    assert ("  rank 2: Timed out waiting 5000ms for recv operation to complete (after rank 1 "
            "stalled)") in text
    assert "Stacks of the stuck ranks (0, 1)" in text


def test_a_lone_timeout_is_still_the_root_cause():
    alone = failure(0, 1.0, exc_type="RuntimeError", message=GLOO_TIMEOUT, traceback="tb")
    other = failure(1, 1.1, exc_type="RuntimeError", message=GLOO_TIMEOUT, traceback="tb")
    text = describe_failure(result_of([alone, other]))
    assert text.startswith("Rank 0 failed first") and "\ntb" in text
    assert "Rank 1 also failed: the same error" in text and "Consequences" not in text
