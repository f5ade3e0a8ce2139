"""A session across machines: the kernel's session (the head) and `elastic-magic join`
agents (real separate processes, each its own node in torch's c10d rendezvous) on loopback."""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_multinode import Machines
from test_session import Watcher, run_in_thread

import elastic_magic as em
from elastic_magic.wire.events import Output, SessionReformed

pytestmark = pytest.mark.cluster


def test_a_session_with_a_joined_machine_runs_cells_there_and_re_forms_when_one_joins(
        tmp_path, log_dir):
    machines = Machines(tmp_path)
    watcher = Watcher()
    try:
        with em.Session(nproc=1, nnodes="2:3", log_dir=log_dir, timeout=120,
                        render=watcher) as s:
            command = s.wait_for_join_command(timeout=60)
            machines.endpoint, machines.token = command.split()[2], s.token  # join HOST:PORT
            machines.join(1)
            s.run("import os, torch, torch.distributed as dist\n"
                  "t = torch.ones(1) * (dist.get_rank() + 1)\n"
                  "dist.all_reduce(t)\n"
                  "print('node', os.environ['GROUP_RANK'], 'has', t.item(), flush=True)",
                  setup=True)
            result = s.run("t.item(), int(os.environ['GROUP_RANK'])")
            assert sorted(result.values.values()) == [(3.0, 0), (3.0, 1)]
            lines = [line for e in watcher.of(Output) for line in e.lines]
            assert "node 0 has 3.0" in lines and "node 1 has 3.0" in lines

            # A machine joins: the next cell re-forms the session on all three, the setup
            # cell replayed everywhere; not a restart.
            machines.join(1)
            watcher.events.clear()
            deadline = time.monotonic() + 90
            result = s.run("t.item(), dist.get_world_size()")
            while result.world_size < 3 and time.monotonic() < deadline:
                time.sleep(0.2)  # until it waits in the rendezvous: the next cell re-forms
                result = s.run("t.item(), dist.get_world_size()")
            assert result.values == {r: (6.0, 3) for r in range(3)}
            assert result.restarts == 0
            assert watcher.of(SessionReformed)[0].world_size == 3
            # A rank on another machine that raises reports it; the session goes on.
            with pytest.raises(em.JobFailedError) as err:
                s.run("if os.environ['GROUP_RANK'] == '2':\n    raise KeyError('far away')")
            assert "far away" in err.value.result.failure.headline
            assert s.run("dist.get_rank()").values == {0: 0, 1: 1, 2: 2}

            # Ctrl-C reaches the ranks of every machine; all come back.
            box = run_in_thread(s, "import time\nprint('nap', flush=True)\n"
                                   "time.sleep(120)\n", watcher)
            assert watcher.wait_for_lines("nap", 3)
            s.interrupt()
            box["thread"].join(60)
            assert box["result"].state is em.JobState.STOPPED
            assert s.status()["restarts"] == "0/3"

            # A machine leaves (Ctrl-C on it): the next cell re-forms without it.
            leaving = machines.procs[1]
            leaving.send_signal(signal.SIGINT)  # ours, by PID
            assert leaving.wait(timeout=60) == 130
            deadline = time.monotonic() + 90
            result = s.run("t.item(), dist.get_world_size()", check=False)
            while result.world_size != 2 and time.monotonic() < deadline:
                result = s.run("t.item(), dist.get_world_size()", check=False)
            assert result.values == {0: (3.0, 2), 1: (3.0, 2)}
            assert result.restarts == 0
        assert machines.procs[0].wait(timeout=60) == 0  # the session's end ends it
    finally:
        machines.reap()


def test_survivors_across_machines_send_the_new_ranks_what_they_lack(tmp_path, log_dir):
    """--survivors across machines: a head's rank is killed between cells; the head's other
    rank stays, and the new ranks (the killed one, and the joined machine's, which starts
    its ranks again every round) get what an ordinary cell defined, through the head's link
    (it was `NameError: name 'total' is not defined` there). A cell that reads a value the
    far rank could not get fails naming it, on no rank, and the group stays."""
    machines = Machines(tmp_path)
    try:
        with em.Session(nproc=2, nnodes="2:2", survivors=True, max_restarts=2,
                        log_dir=log_dir, timeout=120) as s:
            command = s.wait_for_join_command(timeout=60)
            machines.endpoint, machines.token = command.split()[2], s.token
            machines.join(1)
            s.run("import os, threading, torch, torch.distributed as dist", setup=True)
            s.run("factor = 3\n"
                  "def total(n):\n"
                  "    t = torch.ones(1) * n * factor\n"
                  "    dist.all_reduce(t)\n"
                  "    return t.item()\n"
                  "lock = threading.Lock()\n")
            where = s.run("os.getpid(), int(os.environ['GROUP_RANK'])").values
            head = sorted(r for r, (_, node) in where.items()
                          if sum(n == node for _, n in where.values()) == 2)
            far = next(r for r in where if r not in head)
            os.kill(where[head[1]][0], signal.SIGKILL)  # ours, by PID
            watcher = Watcher()
            result = s.run("total(2), os.getpid()", render=watcher)
            assert {r: v[0] for r, v in result.values.items()} == {0: 18.0, 1: 18.0, 2: 18.0}
            assert result.values[head[0]][1] == where[head[0]][0]  # it stayed
            assert all(result.values[r][1] != where[r][0] for r in (head[1], far))
            said = "\n".join(line for e in watcher.of(Output) for line in e.lines)
            new = ", ".join(map(str, sorted((head[1], far))))
            assert f"rank {head[0]} sent its variables to the new ranks {new}: factor, total" \
                in said, said
            assert "lock (TypeError: cannot pickle '_thread.lock' object)" in said
            with pytest.raises(em.JobFailedError) as err:
                s.run("with lock:\n    pass")
            assert "lacks lock, which this cell uses" in err.value.result.failure.message
            assert s.run("lock = threading.Lock()\ntotal(1)").values == {
                0: 9.0, 1: 9.0, 2: 9.0}
            # what every machine's ranks log reaches the cell's result
            logged = s.run("import elastic_magic\nelastic_magic.log(x=total(1), rank='all')")
            assert sorted(logged.metrics["x"].ranks) == [0, 1, 2]
    finally:
        machines.reap()
