"""Survivors stay (issue 21, DESIGN decision 23), beyond the exactness tests that
test_elastic and test_resume run in both modes: which ranks stay after a failure, that a
rank which cannot leave its collective is stopped and started again saying why, and that a
cell without State restarts as before."""

from __future__ import annotations

import textwrap

from conftest import assert_stayed

from elastic_magic.agent.handles.job import Job
from elastic_magic.agent.local.survivors import STUCK
from elastic_magic.events import Restarting, WorkerFailed
from elastic_magic.payload import build_payload
from elastic_magic.spec import JobSpec
from elastic_magic.ui.describe import describe

# Ten steps of a DDP training with a commit each; at step 3 (then 5, 7) of the first
# FAILURES attempts, rank 1 does FAIL_HOW and rank 0 does STALL (or nothing).
TRAIN = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import elastic_magic

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic_magic.State(model=model, optimizer=opt, step=0)
    first = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < FAILURES
    rank = dist.get_rank()
    if first and STALL and rank == 0:  # deaf to the agent's interrupt
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    while state.step < 10:
        if first and state.step == 3 + 2 * int(os.environ["TORCHELASTIC_RESTART_COUNT"]):
            if rank == 1:
                FAIL_HOW()
            elif STALL:  # in no collective, deaf: it cannot leave
                while True:
                    time.sleep(0.05)
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        state.step += 1
        state.commit()
    [p.detach().clone() for p in model.module.parameters()]
""")


def raise_error():
    raise ValueError("rank 1 broke")


def kill_myself():
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def run(log_dir, recorder, fail_how, stall=False, source=TRAIN, failures=1, **spec_args):
    spec = JobSpec.create(2, log_dir=log_dir, max_restarts=failures, survivors=True,
                          **spec_args)
    payload = build_payload(source, spec, namespace={"FAIL_HOW": fail_how, "STALL": stall,
                                                     "FAILURES": failures})
    result = Job(spec, payload).start().wait(recorder)
    assert result.ok, result
    assert result.restarts == failures
    return result


def test_a_survivor_stays_through_several_kills_and_ends_as_without_them(log_dir,
                                                                        recorder):
    import torch

    result = run(log_dir, recorder, kill_myself, failures=3)
    assert_stayed(recorder, [(0,), (0,), (0,)])  # the same rank 0 process throughout
    torch.manual_seed(0)  # the training alone, without a job: every step once
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    for got, want in zip(result.values[0], model.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)


def test_a_rank_that_raised_is_replaced_and_its_peer_stays(log_dir, recorder):
    run(log_dir, recorder, raise_error)
    assert_stayed(recorder, [(0,)])  # rank 0 only lost its peer: it stayed
    assert recorder.of(Restarting)[0].root_cause.exc_type == "ValueError"
    notes = [n.text for e in recorder.events if (n := describe(e)) and n.kind == "start"]
    assert notes[-1].startswith("started ranks 1 after restart 1 (pids ")
    assert notes[-1].endswith("; ranks 0 stayed in their processes")


def test_a_rank_that_cannot_leave_is_stopped_and_started_again_saying_why(log_dir,
                                                                          recorder):
    run(log_dir, recorder, raise_error, stall=True, link_timeout=1.0)
    assert_stayed(recorder, [()])  # rank 0 did not park within the link timeout
    stuck = [e.failure for e in recorder.of(WorkerFailed) if e.failure.reason == STUCK]
    assert [f.rank for f in stuck] == [0]
    assert recorder.of(Restarting)[0].root_cause.rank == 1


WITHOUT_STATE = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
        FAIL_HOW()
    dist.all_reduce(t)
    t.item()
""")


def test_a_cell_without_state_restarts_as_before(log_dir, recorder):
    result = run(log_dir, recorder, raise_error, source=WITHOUT_STATE)
    assert_stayed(recorder, [()])  # nothing to roll back to: every rank started again
    assert result.values == {0: 4.0, 1: 4.0}


def test_the_flag_keeps_survivors_in_a_notebook_cell(ip, log_dir, capsys):
    """%%elastic --survivors: the text output says which rank stayed."""
    ip.user_ns.update(FAIL_HOW=kill_myself, STALL=False, FAILURES=1)
    result = ip.run_cell_magic(
        "elastic", f"--nproc 2 --max-restarts 1 --survivors --text --log-dir {log_dir}",
        TRAIN)
    assert result.ok and result.restarts == 1
    assert "ranks 0 stayed in their processes" in capsys.readouterr().out
