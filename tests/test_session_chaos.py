"""Chaos for a session whose survivors stay (``--survivors``): ranks SIGKILLed at random
moments inside training cells (in a step, in a commit), between cells with the next cell
sent at once, and while a new rank replays the setup cells; resizes between cells. After
every cell each rank holds the same commit, every step is applied once, and nothing hangs.

The training records itself: step s adds 1 at index s of ``state.w`` (an all-reduce of a
one-hot, divided by the world size: exact in float64), so a step applied twice, lost, or
held by one rank and not another shows in the vector itself."""

from __future__ import annotations

import os
import random
import signal
import textwrap
import threading
import time

import pytest
from conftest import tagged_workers

import elastic_magic as em

pytestmark = pytest.mark.soak

# CI fires 16 events (about a minute on 2 cores); ELASTIC_MAGIC_SESSION_CHAOS_EVENTS=100 or
# more is a longer run.
EVENTS = int(os.environ.get("ELASTIC_MAGIC_SESSION_CHAOS_EVENTS", "16"))
STEPS_A_CELL = 6
TOTAL = STEPS_A_CELL * EVENTS + 8

SETUP = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist, elastic_magic as em
    state = em.State(step=0, w=torch.zeros(TOTAL, dtype=torch.float64))

    def die_if_planned(moment):
        # The test plans one kill of the rank that reaches ``moment`` first (a rename
        # takes the plan once).
        plan = os.path.join(PLANS, moment)
        try:
            os.rename(plan, f"{plan}.taken-{os.getpid()}")
        except FileNotFoundError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    die_if_planned("setup")  # a new rank replays this cell alone
""")

# An ordinary cell: rank 0's train is sent to the ranks that join.
TRAIN = textwrap.dedent("""
    def train(steps):
        for _ in range(steps):
            g = torch.zeros(TOTAL, dtype=torch.float64)
            g[state.step] = 1.0
            dist.all_reduce(g)
            state.w += g / dist.get_world_size()
            state.step += 1
            state.commit()
            time.sleep(0.05)  # a cell of 6 steps takes about half a second
        return state.step
""")

LOOK = ("t = torch.ones(1)\ndist.all_reduce(t)\n"
        "(os.getpid(), state.step, state.w.tolist(), int(t.item()), 'train' in globals())")


class SessionChaos:
    def __init__(self, session: em.Session, seed: int, plans: str) -> None:
        self.s = session
        self.rng = random.Random(seed)
        self.plans = plans
        self.size = 2
        self.pids: dict[int, int] = {}
        self.log: list[str] = []

    def look(self) -> None:
        """Every rank at the same commit, each of its steps applied once. (The world may be
        smaller than asked: a slot killed twice is left out while --min-nproc allows.)"""
        result = self.s.run(LOOK)
        values = result.values
        self.size = len(values)
        assert sorted(values) == list(range(self.size)), (values.keys(), self.log)
        steps = {v[1] for v in values.values()}
        assert len(steps) == 1, ({r: v[1] for r, v in values.items()}, self.log)
        step = steps.pop()
        for rank, (_, _, w, world, _) in values.items():
            assert world == self.size, (rank, world, self.log)  # every rank in the group
            assert w == [1.0] * step + [0.0] * (TOTAL - step), (rank, step, self.log)
        self.pids = {rank: v[0] for rank, v in values.items()}
        # A rank that joined got train from a survivor; with none left (a survivor whose
        # rank would change starts again too: its namespace was made as its rank), no rank
        # has it, and the cell that made it runs again, as a user would run it.
        has_train = {v[4] for v in values.values()}
        assert len(has_train) == 1, ({r: v[4] for r, v in values.items()}, self.log)
        if not has_train.pop():
            self.s.run(TRAIN)
            self.log.append("no rank stayed: train defined again")

    def kill_in_a_cell(self) -> None:
        rank = self.rng.randrange(self.size)
        delay = self.rng.uniform(0.0, 0.6)
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                self.s.run(f"train({STEPS_A_CELL})")
                outcome.append(None)
            except BaseException as exc:  # the death fails the cell, or it had ended
                outcome.append(exc)

        cell = threading.Thread(target=run, daemon=True)
        cell.start()
        time.sleep(delay)
        os.kill(self.pids[rank], signal.SIGKILL)
        cell.join(timeout=180)
        assert not cell.is_alive(), f"a cell with rank {rank} killed hung ({self.log})"
        error = outcome[0]
        assert error is None or isinstance(error, em.JobFailedError), (error, self.log)
        self.log.append(f"killed rank {rank} {delay:.2f}s into a cell "
                        f"({'it failed' if error else 'after it ended'})")

    def kill_between_cells(self) -> None:
        rank = self.rng.randrange(self.size)
        os.kill(self.pids[rank], signal.SIGKILL)  # the next cell (look) is sent at once
        self.log.append(f"killed rank {rank} between cells")

    def kill_in_a_replay(self) -> None:
        rank = self.rng.randrange(self.size)
        with open(os.path.join(self.plans, "setup"), "w"):
            pass  # the new rank dies in its replay of the setup cell
        os.kill(self.pids[rank], signal.SIGKILL)
        self.log.append(f"killed rank {rank}, its replacement in its setup replay")

    def resize(self) -> None:
        size = self.rng.choice([n for n in (1, 2, 3) if n != self.size])
        self.s.scale(size, include=range(3))  # slots left out may come back
        self.log.append(f"resized to {size}")

    def run(self) -> None:
        self.look()
        events = [self.kill_in_a_cell] * 4 + [self.kill_between_cells, self.kill_in_a_replay,
                                              self.resize, self.resize]
        for _ in range(EVENTS):
            self.rng.choice(events)()
            self.look()
            plan = os.path.join(self.plans, "setup")
            if os.path.exists(plan):  # no rank replayed: the killed slot was left out
                os.remove(plan)
                self.log.append("no rank joined: the plan was not taken")
            self.s.run(f"train({self.rng.randint(1, 3)})")  # it goes on
            self.look()


@pytest.mark.timeout(1200)
def test_a_session_with_survivors_keeps_every_rank_at_one_commit_through_chaos(
        log_dir, tmp_path):
    seed = int(os.environ.get("ELASTIC_MAGIC_CHAOS_SEED") or random.randrange(2**32))
    plans = tmp_path / "plans"
    plans.mkdir()
    with em.Session(nproc=2, min_nproc=1, max_nproc=3, max_restarts=10 * EVENTS,
                    survivors=True, log_dir=log_dir, timeout=60) as s:
        s.push(TOTAL=TOTAL, PLANS=str(plans), setup=True)
        s.run(SETUP, setup=True)
        s.run(TRAIN)
        chaos = SessionChaos(s, seed, str(plans))
        try:
            chaos.run()
        except BaseException as exc:
            raise AssertionError(f"chaos seed {seed} (ELASTIC_MAGIC_CHAOS_SEED replays its "
                                 f"choices, not their timing): {chaos.log}") from exc
    assert not tagged_workers()
