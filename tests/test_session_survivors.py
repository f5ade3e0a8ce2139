"""Survivors stay in sessions (``--survivors``): a rank that dies, between
cells or in one, and a resize between cells re-form the group without restarting the
healthy ranks; they keep their processes and namespaces, and only the new ranks replay the
setup cells (pushed values and State included)."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from conftest import tagged_workers
from test_session import Watcher

import elastic_magic as em
from elastic_magic.wire.events import (
    SessionBroken,
    SessionReformed,
    WorkerFailed,
    WorkersStarted,
)

# Every rank's process, whether its own variables are still there, and a collective on the
# group as it is now (its world size, summed).
LOOK = ("import torch, torch.distributed as dist\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "(os.getpid(), globals().get('only_here'), base, pushed, state.step, int(t.item()))")


# An ordinary cell's definitions (rank 0's are sent to a rank that joins), and a cell that
# uses them: train and Counter read the globals of the rank they run on; lock is not sent.
DEFINITIONS = ("import threading\n"
               "def scale(x):\n"  # a fix of the setup cell's: every rank runs this one
               "    return 10 * x\n"
               "def train(steps):\n"
               "    return base + steps - state.step\n"
               "class Counter:\n"
               "    def __init__(self):\n"
               "        self.n = base\n"
               "    def up(self):\n"
               "        self.n += 1\n"
               "        return self.n\n"
               "lock = threading.Lock()\n"
               "import torch.utils.data.distributed as tud\n"  # tied, inside a value:
               "held = {'sampler': tud.DistributedSampler(range(4), num_replicas=1, rank=0)}\n")
USE = (" + (train(8), Counter().up(), state.step + 7, train.__globals__ is globals(), "
       "'lock' not in globals(), scale(1))")


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_survivor_keeps_its_process_and_namespace_when_a_rank_dies_between_cells(log_dir):
    with em.Session(nproc=2, max_restarts=2, survivors=True, log_dir=log_dir) as s:
        s.run("import os, elastic_magic as em\nbase = 7\nstate = em.State(step=0)\n"
              "def scale(x):\n    return x\n", setup=True)
        s.push(pushed=11, setup=True)
        s.run("for _ in range(3):\n"
              "    state.step += 1\n"
              "    state.commit()\n"
              "if int(os.environ['RANK']) == 0:\n"
              "    only_here = 'rank 0 made it'\n")  # not a setup cell
        s.run(DEFINITIONS)  # nor this: the new rank gets these from rank 0
        pids = s.run("os.getpid()").values
        os.kill(pids[1], signal.SIGKILL)  # between cells, and the next cell sent at once:
        watcher = Watcher()  # it waits for the re-formed group (it failed, spending a restart)
        result = s.run(LOOK + USE, render=watcher)
        assert s.status()["restarts"] == "1/2"
        survivor, new = result.values[0], result.values[1]
        # train and Counter read the new rank's own base and state (from its setup cells)
        assert survivor == (pids[0], "rank 0 made it", 7, 11, 3, 2, 12, 8, 10, True, False,
                            10)
        assert new[0] not in pids.values()
        assert new[1:] == ("rank 0 made it", 7, 11, 3, 2, 12, 8, 10, True, True, 10)
        said = "\n".join(result.tails[0])  # once, on rank 0's output
        assert "rank 0 sent its variables to the new rank 1: Counter, only_here, scale, " \
               "threading, train, tud" in said
        assert "not sent to the new rank 1, which lacks them until a cell defines them: " \
               "held (TypeError: holds a torch.utils.data.distributed.DistributedSampler, " \
               "tied to this process or its process group (make it in a setup cell)); " \
               "lock (TypeError: cannot pickle '_thread.lock' object)" in said, said
        # A cell that reads what the new rank lacks runs on no rank and says so; the group
        # stays as it is.
        with pytest.raises(em.JobFailedError) as err:
            s.run("def hold():\n    with lock:\n        return 1\nhold()")
        failure = err.value.result.failure
        assert (failure.rank, failure.exc_type) == (1, "NameError")
        assert failure.message.startswith("rank 1 lacks lock, which this cell uses")
        assert s.run("lock = threading.Lock()\nos.getpid()").values == {0: pids[0],
                                                                         1: new[0]}
        assert [e.stayed for e in watcher.of(WorkersStarted)] == [(0,)]
        assert [(r.setup_cells, r.world_size) for r in watcher.of(SessionReformed)] == [(2, 2)]
        # Why, with the rank and the signal: the killed rank was no survivor (its shepherd
        # outlives it a moment), and its failure is the kill (not the teardown's SIGTERM).
        assert [b.reason for b in watcher.of(SessionBroken)] == [
            "rank 1 was killed by SIGKILL while the session was idle"]
        assert _gone(pids[1])
    assert not tagged_workers()


def test_a_resize_between_cells_keeps_the_ranks_that_stay_in_the_group(log_dir):
    with em.Session(nproc=2, max_nproc=3, survivors=True, log_dir=log_dir) as s:
        s.run("import os, elastic_magic as em\nbase = 7\nstate = em.State(step=0)\n",
              setup=True)
        s.push(pushed=11, setup=True)
        s.run("state.step = 5\nstate.commit()\nonly_here = int(os.environ['RANK'])")
        pids = s.run("os.getpid()").values
        s.scale(3)
        watcher = Watcher()
        result = s.run(LOOK, render=watcher)
        assert result.values[0] == (pids[0], 0, 7, 11, 5, 3)
        assert result.values[1] == (pids[1], 1, 7, 11, 5, 3)
        assert result.values[2][1:] == (0, 7, 11, 5, 3)  # rank 0's only_here, sent to it
        assert result.restarts == 0 and result.resizes == 1
        assert [e.stayed for e in watcher.of(WorkersStarted)] == [(0, 1)]
        third = result.values[2][0]

        s.scale(2)  # down again: rank 2 ends, ranks 0 and 1 keep what they had
        result = s.run(LOOK)
        assert result.values == {0: (pids[0], 0, 7, 11, 5, 2), 1: (pids[1], 1, 7, 11, 5, 2)}
        assert _gone(third)
    assert not tagged_workers()


def test_a_death_in_a_cell_fails_that_cell_and_the_next_runs_on_the_survivors(ip, log_dir,
                                                                             capsys):
    ip.run_line_magic("elastic", f"session start --nproc 2 --max-restarts 1 --survivors "
                                 f"--log-dir {log_dir}")
    ip.run_cell_magic("elastic", "--setup", "import os, time, elastic_magic as em\n"
                                            "base = 7\nstate = em.State(step=0)\n")
    # ``old``: a State of an earlier try, still held; ``state``'s commits are the latest.
    pids = ip.run_cell_magic("elastic", "", "old = em.State(step=100)\nold.commit()\n"
                                            "state.step = 4\nstate.commit()\n"
                                            "os.getpid()").values
    # Rank 0 waits for rank 1, which dies: the agent's word brings rank 0 back, and it
    # stays. The barrier: rank 1 dies once both ranks have set ``only_here`` and gone a
    # step past the last commit (a kill between an optimizer step and its commit).
    with pytest.raises(em.JobFailedError) as err:
        ip.run_cell_magic("elastic", "", "import torch, torch.distributed as dist\n"
                                         "only_here = 'before the death'\n"
                                         "state.step += 1\n"
                                         "dist.barrier()\n"
                                         "if int(os.environ['RANK']) == 1:\n"
                                         "    os._exit(3)\n"
                                         "time.sleep(60)\n")
    failure = err.value.result.failure
    assert failure.rank == 1 and failure.exit_code == 3
    capsys.readouterr()
    result = ip.run_cell_magic("elastic", "", "import torch.distributed as dist\n"
                                              "(os.getpid(), globals().get('only_here'), "
                                              "base, dist.get_world_size(), state.step, "
                                              "globals()['old'].step "
                                              "if 'old' in globals() else None)")
    # Every rank at the last commit: the survivor went back from step 5, and says so (it
    # stayed at 5 while the new rank restored 4, and the next collectives hung).
    # Only the State the last commit belongs to goes back (``old`` keeps its step; as a
    # State it is not sent to the new rank).
    assert result.values[0] == (pids[0], "before the death", 7, 2, 4, 100)
    assert result.values[1][0] != pids[1]
    assert result.values[1][1:] == ("before the death", 7, 2, 4, None)  # rank 0's, sent
    assert any("rank 0: State back at the last commit (step 4) from step 5" in line
               for line in result.tails[0]), result.tails
    assert result.restarts == 1
    ip.run_line_magic("elastic", "session stop")
    assert not tagged_workers()


def test_setup_cells_replayed_alone_have_the_group_and_a_collective_restarts_every_rank(
        log_dir):
    """A new rank replays the setup cells on the session's new process group, alone:
    its rank and the world size are there, so the survivor stays. A collective in a
    setup cell would wait for the survivors for ever: it is refused on the new rank, and
    the session re-forms as without the flag (no restart spent on it)."""
    with em.Session(nproc=2, max_restarts=2, survivors=True, log_dir=log_dir) as s:
        s.run("import os, torch, torch.distributed as dist\n"
              "from torch.distributed import all_reduce\n"  # the name bound while alone
              "r, n = dist.get_rank(), dist.get_world_size()\n", setup=True)
        s.run("only_here = 'not a setup cell'")
        pids = s.run("os.getpid()").values
        os.kill(pids[1], signal.SIGKILL)
        look = "t = torch.ones(1)\nall_reduce(t)\n" \
               "(os.getpid(), globals().get('only_here'), r, n, int(t.item()))"
        result = s.run(look)
        assert result.values[0] == (pids[0], "not a setup cell", 0, 2, 2)
        assert result.values[1][0] != pids[1]
        assert result.values[1][1:] == ("not a setup cell", 1, 2, 2)  # rank 0's, sent
        assert result.restarts == 1

        s.run("dist.barrier()", setup=True)  # fine on every rank; refused on one alone
        pids = s.run("os.getpid()").values
        os.kill(pids[1], signal.SIGKILL)
        watcher = Watcher()
        result = s.run(look, render=watcher)
        assert s.status()["restarts"] == "2/2"
        assert result.values[0][1:] == (None, 0, 2, 2) and result.values[1][1:] == (
            None, 1, 2, 2)
        assert not {result.values[0][0], result.values[1][0]} & set(pids.values())
        assert [e.stayed for e in watcher.of(WorkersStarted)] == [(0,), ()]
        refused = [e.failure for e in watcher.of(WorkerFailed)
                   if e.failure.exc_type == "AloneError"]
        assert [f.rank for f in refused] == [1], watcher.events
        assert "torch.distributed.barrier in a setup cell replayed" in refused[0].message
        assert result.restarts == 2
    assert not tagged_workers()


def test_a_rank_whose_setup_replay_a_death_cut_short_does_not_stay(log_dir, tmp_path):
    """Both ranks died between cells; as the new ranks replayed the setup cells, rank 1
    died, and rank 0 (interrupted in its replay) had not defined what the last setup cell
    defines. It must not stay as a survivor: the next cell would meet a rank without
    ``after`` (a full run's NameError in test_session_chaos)."""
    flag = str(tmp_path / "died")
    with em.Session(nproc=2, max_restarts=3, survivors=True, log_dir=log_dir) as s:
        s.run("import os, time\nbase = 7", setup=True)
        s.run(f"if os.environ['TORCHELASTIC_RESTART_COUNT'] != '0' "
              f"and not os.path.exists({flag!r}):\n"
              f"    if os.environ['RANK'] == '1':\n"
              f"        open({flag!r}, 'w').close()\n"
              f"        os.kill(os.getpid(), 9)\n"
              f"    while not os.path.exists({flag!r}):\n"
              f"        time.sleep(0.01)\n"
              f"    time.sleep(5)  # in its replay when rank 1's death is found\n"
              f"after = base + 1\n", setup=True)
        pids = s.run("os.getpid()").values
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)  # workers this session started
        result = s.run("(after, base, os.getpid())")
        assert [v[:2] for v in result.values.values()] == [(8, 7), (8, 7)], result.values
        assert os.path.exists(flag)  # rank 1 died in the replay, as planned


def test_a_survivor_goes_back_to_the_first_values_when_nothing_was_committed(log_dir):
    """A death in a cell before the session's first commit: the new rank's State starts
    from its first values (there is nothing to restore), and the survivor, a step further
    when its peer died, goes back to them too. (It stayed a step ahead, and the next cells
    saw two different steps: session chaos, killed 0.00 s into its first cell.)"""
    with em.Session(nproc=2, max_restarts=1, survivors=True, log_dir=log_dir) as s:
        s.run("import os, time, torch, torch.distributed as dist, elastic_magic as em\n"
              "state = em.State(step=0, w=torch.zeros(3))", setup=True)
        pids = s.run("os.getpid()").values
        with pytest.raises(em.JobFailedError):
            s.run("state.step += 1\nstate.w += 1\ndist.barrier()\n"
                  "if dist.get_rank() == 1:\n    os._exit(3)\ntime.sleep(60)")
        result = s.run("(os.getpid(), state.step, state.w.tolist())")
        assert result.values[0] == (pids[0], 0, [0.0, 0.0, 0.0])  # stayed, and went back
        assert result.values[1][0] != pids[1] and result.values[1][1:] == (0, [0.0] * 3)
        assert any("rank 0: State back at the last commit (step 0) from step 1" in line
                   for line in result.tails[0]), result.tails
