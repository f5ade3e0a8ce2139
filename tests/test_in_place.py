"""Survivors go on in place (``elastic_magic.run``, Horovod's ``hvd.elastic.run``): a
survivor stays in the function's caller through a peer's death and a resize, keeps what
the cell made before the call, and rolls back from its own memory when nothing it holds
changed since the commit (from the agent's copy otherwise); the training ends as without
failures."""

from __future__ import annotations

import re
import textwrap
import threading

import pytest
from conftest import assert_stayed

from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.events import Committed
from elastic_magic.wire.payload import build_payload

WIDTH = 600  # the model's state is above kept.COPY_LIMIT: kept as versions, not a copy

# Rank 1 dies before its forward at step 3 (rank 0 then waits in the backward's all-reduce:
# nothing changed since the commit) and after the optimizer step at step 6 (a barrier makes
# sure rank 0 has stepped too); the test resizes to 3 once rank 0 prints STEP 9.
CELL = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist, elastic_magic
    from torch.nn.parallel import DistributedDataParallel as DDP
    with open(os.path.join(OUT, f"top_{os.getpid()}"), "a") as f:
        f.write("ran\\n")  # the cell's top, once per process that runs it
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = elastic_magic.State(model=model, optimizer=opt, step=0)
    resets = []
    state.on_reset(lambda: resets.append(dist.get_world_size()))

    @elastic_magic.run
    def train(state):
        ddp = DDP(model)
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        rank = dist.get_rank()
        if rank == 0:
            print("ENTER", state.step, "memory" if state._kept else "agent", resets,
                  flush=True)
        while state.step < 12:
            if (attempt, state.step, rank) == (0, 3, 1):
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            ddp(torch.ones(2, WIDTH)).square().mean().backward()
            opt.step()
            if (attempt, state.step) == (1, 6):
                dist.barrier()  # rank 0 has stepped too (else it may be stopped before)
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            state.step += 1
            if rank == 0:
                print("STEP", state.step, flush=True)
            if state.step >= 9 and dist.get_world_size() == 2:
                time.sleep(0.2)  # the resize is applied at one of these commits
            state.commit()
        return [p.detach().clone() for p in model.parameters()]

    train(state)
""")


def baseline():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(12):
        opt.zero_grad()
        model(torch.ones(2, WIDTH)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_survivors_go_on_in_place_through_kills_and_a_resize(tmp_path, log_dir, recorder):
    import torch

    spec = JobSpec.create(2, log_dir=log_dir, max_restarts=2, survivors=True, max_nproc=3)
    payload = build_payload(CELL, spec, namespace={"OUT": str(tmp_path), "WIDTH": WIDTH})
    job = Job(spec, payload).start()

    def resize_at_step_nine():
        while not any(line == "STEP 9" for line in recorder.lines(0)):
            threading.Event().wait(0.02)
        job.scale(3)

    threading.Thread(target=resize_at_step_nine, daemon=True).start()
    result = job.wait(recorder)
    assert result.ok and result.restarts == 2 and result.world_size == 3, result
    assert_stayed(recorder, [(0,), (0,), (0, 1)])
    enters = [line.split(maxsplit=1)[1] for line in recorder.lines(0)
              if line.startswith("ENTER")]
    # rolled back from its own memory after a death in the collectives and at the resize,
    # from the agent's copy after a death once rank 0 had stepped; reset callbacks each time
    assert enters[:3] == ["0 agent []", "3 memory [2]", "6 agent [2, 2]"], enters
    assert len(enters) == 4 and re.fullmatch(r"(9|10|11) memory \[2, 2, 3\]", enters[3])
    tops = {path.name: path.read_text().count("ran") for path in tmp_path.glob("top_*")}
    # 2 first ranks, 2 replacing rank 1, 1 added: no process ran the cell's top twice
    assert sorted(tops.values()) == [1] * 5, tops
    for got, want in zip(result.values[0], baseline(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("killed_at", "committed"), [
    (6, {0: [4, 8, 12], 1: [8, 12]}), (2, {0: [4, 8, 12], 1: [4, 8, 12]})])
def test_commits_every_few_steps_count_from_the_commit_a_survivor_rolled_back_to(
        killed_at, committed, log_dir, recorder):
    """``commit(every=4)``: rank 1 dies at step 6, two calls past the commit of step 4.
    Rank 0 rolls back to it in place and the new rank 1 restores it: both commit next at
    step 8, not rank 0 at step 6 (its count since the commit, kept through the rollback,
    had it commit where the new rank ran a step: a hang in mismatched collectives). Killed
    at step 2, before any commit: rank 0 goes back in place to the State's first values,
    where the new rank starts (it went on from step 2, and trained two steps fewer)."""
    cell = textwrap.dedent("""
        import os, signal, torch, torch.distributed as dist, elastic_magic
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = torch.nn.Linear(4, 1)
        state = elastic_magic.State(model=model, step=0)
        commits = []

        @elastic_magic.run
        def train(state):
            ddp = DDP(model)
            while state.step < 12:
                ddp(torch.ones(2, 4)).sum().backward()
                state.step += 1
                if state.commit(every=4):
                    commits.append(state.step)
                if (os.environ["TORCHELASTIC_RESTART_COUNT"], state.step, dist.get_rank()) \
                        == ("0", KILLED_AT, 1):
                    os.kill(os.getpid(), signal.SIGKILL)

        train(state)
        commits
    """)
    spec = JobSpec.create(2, log_dir=log_dir, max_restarts=1, survivors=True,
                          stall_timeout=30)
    payload = build_payload(cell, spec, namespace={"KILLED_AT": killed_at})
    result = Job(spec, payload).start().wait(recorder)
    assert result.ok, f"{result}\n{recorder.story()}"
    assert_stayed(recorder, [(0,)])
    assert result.values == committed, result.values


# Rank 0 is held after every rank agreed on the commit of step 3 and before its send
# starts (copying a value of the State is the last thing before it), until the agent's word
# has come: rank 1 died right after that commit. Then rank 1 dies inside the commit of
# step 6 (its state_dict), while rank 0 goes on to where the ranks agree on it.
WORD_IN_COMMIT = textwrap.dedent("""
    import os, signal, threading, torch, torch.distributed as dist, elastic_magic

    def now():  # None while the State is being made (it reads each object's state)
        if "state" not in globals():
            return None
        return int(os.environ["TORCHELASTIC_RESTART_COUNT"]), state.step, dist.get_rank()

    class Held:
        def __reduce__(self):
            return (int, (0,))

        def __deepcopy__(self, memo):
            if now() == (0, 3, 0):
                print("HELD", flush=True)
                word = signal.sigtimedwait({signal.SIGINT}, 60)  # taken, then sent again:
                print("WORD" if word else "NO WORD", flush=True)
                signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # as it came
            return self

    class DiesInCommit:
        def state_dict(self):
            if now() == (1, 6, 1):
                os.kill(os.getpid(), signal.SIGKILL)
            return {}

        def load_state_dict(self, state_dict):
            pass

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic_magic.State(model=model, optimizer=opt, dies=DiesInCommit(), step=0,
                                held=Held())

    @elastic_magic.run
    def train(state):
        rank = dist.get_rank()
        if rank == 0:
            print("ENTER", state.step, "memory" if state._kept else "agent", flush=True)
        while state.step < 8:
            if now() == (0, 3, 1):
                os.kill(os.getpid(), signal.SIGKILL)
            model(torch.ones(2, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state.step += 1
            state.commit()
        return state.step

    train(state)
""")


def test_the_agents_word_between_a_commits_agreement_and_its_send_loses_no_commit(
        log_dir, recorder):
    """The agent asks rank 0 to leave (its peer died right after the commit of step 3)
    while rank 0 is held where every rank has agreed on that commit and its send has not
    started: the word waits until the send has started, so the agent has the commit that
    rank 0 holds, and rank 0 goes on from it in place (before: from step 2, the commit of
    step 3 lost). A peer that dies inside a commit still has rank 0 leave it."""
    spec = JobSpec.create(2, log_dir=log_dir, max_restarts=2, survivors=True)
    job = Job(spec, build_payload(WORD_IN_COMMIT, spec)).start()
    result = job.wait(recorder)
    lines = recorder.lines(0)
    assert result.ok and result.restarts == 2 and result.values == {0: 8, 1: 8}, \
        (result, lines)
    assert_stayed(recorder, [(0,), (0,)])
    assert [line for line in lines if line in ("HELD", "WORD", "NO WORD")] == \
        ["HELD", "WORD"]
    enters = [line.split(maxsplit=1)[1] for line in lines if line.startswith("ENTER")]
    assert enters == ["0 agent", "3 memory", "5 memory"], enters
    assert [event.step for event in recorder.of(Committed)] == list(range(1, 9))


# Rank 1 dies at step 3; rank 0's all-reduce fails at once, and the agent's word (Interrupt)
# comes too. Rank 0 holds the word in its listener until its main thread, unwinding from
# the failed collective, has reached rejoin and not yet paused: the word lands there.
WORD_BEFORE_PAUSE = textwrap.dedent("""
    import os, signal, threading, time, torch, torch.distributed as dist, elastic_magic
    from elastic_magic.worker import leave
    with open(os.path.join(OUT, f"top_{os.getpid()}"), "a") as f:
        f.write("ran\\n")
    model = torch.nn.Linear(4, 4)
    state = elastic_magic.State(model=model, step=0)
    if dist.get_rank() == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        failed = threading.Event()
        agents_word, pause = leave.ask, leave.pause

        def held_word():  # the listener: the agent's word waits for the failure
            failed.wait(30)
            agents_word()

        def late_pause():  # the main thread, failed, on its way to pause
            if not failed.is_set():
                try:
                    failed.set()
                    for _ in range(3000):  # short sleeps: a signal's flag is seen within one
                        time.sleep(0.01)
                    print("NO WORD", flush=True)
                except KeyboardInterrupt:
                    print("WORD BEFORE PAUSE", leave.asked(), flush=True)
                    raise
            pause()

        leave.ask, leave.pause = held_word, late_pause

    @elastic_magic.run
    def train(state):
        rank = dist.get_rank()
        if rank == 0:
            print("ENTER", state.step, flush=True)
        while state.step < 6:
            if (os.environ["TORCHELASTIC_RESTART_COUNT"], state.step, rank) == ("0", 3, 1):
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1))
            state.step += 1
            state.commit()
        return state.step

    train(state)
""")


def test_the_agents_word_that_comes_as_a_survivor_leaves_its_failed_group_keeps_it_in_place(
        tmp_path, log_dir, recorder):
    """The word for the failure the survivor is already leaving for (it reaches a
    collective and the agent at once) is taken as said: the survivor goes on in place
    (before: the KeyboardInterrupt unwound the cell, which ran again from the top)."""
    spec = JobSpec.create(2, log_dir=log_dir, max_restarts=1, survivors=True)
    payload = build_payload(WORD_BEFORE_PAUSE, spec, namespace={"OUT": str(tmp_path)})
    result = Job(spec, payload).start().wait(recorder)
    lines = recorder.lines(0)
    assert result.ok and result.restarts == 1 and result.values == {0: 6, 1: 6}, \
        f"{result}\n{recorder.story()}"
    assert "WORD BEFORE PAUSE True" in lines, lines  # the agent's word, not a stop
    assert_stayed(recorder, [(0,)])
    assert [line for line in lines if line.startswith("ENTER")] == ["ENTER 0", "ENTER 3"]
    tops = sorted(path.read_text().count("ran") for path in tmp_path.glob("top_*"))
    assert tops == [1, 1, 1], tops  # rank 0 did not run the cell again


# A sharded State cannot go on in place (its parameters are laid out over the old group):
# the survivor stays in its process and runs the cell again from the top.
SHARDED = textwrap.dedent("""
    import os, signal, torch, torch.distributed as dist, elastic_magic
    from torch.distributed.fsdp import fully_shard
    with open(os.path.join(OUT, f"top_{os.getpid()}"), "a") as f:
        f.write("ran\\n")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = elastic_magic.State(model=model, optimizer=opt, step=0)

    @elastic_magic.run
    def train(state):
        while state.step < 6:
            if (KILL and state.step == 3 and dist.get_rank() == 1
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                os.kill(os.getpid(), signal.SIGKILL)
            model(torch.ones(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state.step += 1
            state.commit()
        return [p.full_tensor().clone() for p in model.parameters()]

    train(state)
""")


def test_a_sharded_state_runs_the_cell_again_in_the_survivors_process(tmp_path, log_dir,
                                                                      recorder):
    import torch

    def run(kill, out):
        out.mkdir()
        spec = JobSpec.create(2, log_dir=log_dir, max_restarts=1, survivors=True)
        payload = build_payload(SHARDED, spec, namespace={"OUT": str(out), "KILL": kill})
        return Job(spec, payload).start().wait(recorder if kill else lambda events: None)

    killed, undisturbed = run(True, tmp_path / "killed"), run(False, tmp_path / "whole")
    assert killed.ok and killed.restarts == 1 and undisturbed.ok, (killed, undisturbed)
    assert_stayed(recorder, [(0,)])
    tops = sorted(path.read_text().count("ran") for path in (tmp_path / "killed").iterdir())
    assert tops == [1, 1, 2], tops  # rank 0 ran it twice in its one process
    for got, want in zip(killed.values[0], undisturbed.values[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_commit_is_kept_by_versions_and_dropped_where_copies_would_cost():
    """The record each rank keeps of its commit (a unit: no outside): large objects by their
    tensors' versions, so an optimizer step, or a tensor replaced, sends the rollback to the
    agent's copy; values holding large tensors are not kept at all (copying them at every
    commit would cost the training more than the rollback saves)."""
    import torch

    from elastic_magic.training.kept import COPY_LIMIT, Kept

    model = torch.nn.Linear(WIDTH, WIDTH)  # above COPY_LIMIT
    small = torch.nn.Linear(2, 2)
    objects = {"model": model, "small": small}
    kept = Kept.of(7, {n: o.state_dict() for n, o in objects.items()}, {"step": 3}, 3,
                   [{"seed": 0}], 0)
    assert kept is not None and set(kept.signatures) == {"model"} and set(kept.copies) == {
        "small"}
    assert kept.holds(7, objects) and not kept.holds(8, objects)
    with torch.no_grad():
        small.weight.add_(1)  # kept as a copy: restored from it, whatever happened to it
    assert kept.holds(7, objects)
    with torch.no_grad():
        model.weight.add_(1)  # an in-place write: its version moved
    assert not kept.holds(7, objects)
    big = torch.zeros(COPY_LIMIT // 4 + 1)
    assert Kept.of(7, {}, {"buffer": big}, 3, [{"seed": 0}], 0) is None


def test_a_commit_the_rank_holds_is_not_sent_to_it():
    """A survivor going on in place names the commit it holds (``StateGet.held``): when it
    is the latest, the agent answers without the snapshot, to its own ranks and to a joined
    machine's (which would otherwise have it streamed first); an older one gets it all."""
    from elastic_magic.agent.machines.remote_state import answer_node
    from elastic_magic.agent.node.snapshots import SnapshotStore, StateServer
    from elastic_magic.wire.link_messages import NodeReply, NodeRequest
    from elastic_magic.wire.messages import Reply, StateGet, StateReply

    store = SnapshotStore()
    server = StateServer(store, emit=lambda event: None, leave_at_commit=lambda: False)
    store.commit({"step": 3}, data=b"x" * 1000, token=77)
    held = StateReply(store.commit_id, token=77)
    assert server.get(inline=False, held=77) == held
    assert server.get(inline=True, held=76).snapshot == b"x" * 1000  # an older commit
    assert server.get(inline=True).snapshot == b"x" * 1000

    class Link:  # the joined machine's end: what the head sends it
        def __init__(self) -> None:
            self.sent: list[object] = []

        def send(self, message: object) -> None:
            self.sent.append(message)

    link = Link()
    answer_node(None, link, 1, NodeRequest(0, 0, StateGet(5, held=77)), server, 2)
    assert link.sent == [NodeReply(0, 0, Reply(5, held))]  # at once, nothing streamed
