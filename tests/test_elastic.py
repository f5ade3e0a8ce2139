"""Elasticity acceptance: one deterministic training run (a) uninterrupted on 2 workers,
(b) with a worker killed mid-training and restarted, (c) resized 2 -> 3 -> 1 while it
trains. (b) and (c) must end with the parameters of (a), every step committed once."""

from __future__ import annotations

import io
import textwrap
import threading

import pytest
import torch
from conftest import assert_stayed, done_steps, run_resized

import elastic_magic as em
from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec, SpecError
from elastic_magic.training import snapshot_format
from elastic_magic.ui.describe import describe
from elastic_magic.wire.events import (
    Committed,
    Excluded,
    MembershipChanged,
    Output,
    ResizeRequested,
    WorkerFailed,
)
from elastic_magic.wire.payload import build_payload

# Fixed global batch of 12 (divisible by 1, 2 and 3 ranks), fixed seeds, 2 epochs of 20.
TRAIN = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import elastic_magic

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(240, 8, generator=g)
    target = torch.sin(data.sum(1, keepdim=True))
    sampler = elastic_magic.ElasticSampler(len(data), 12, seed=0)
    state = elastic_magic.State(model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                                step=0, epoch=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    # {step: path}: before that step, training waits for the file (a test's driver makes
    # it once the job has grown): growth then never races the job's end
    holds = globals().get("HOLDS", {})
    print(f"START step {state.step} world {world}", flush=True)
    for epoch in range(state.epoch, 2):
        sampler.set_epoch(epoch)
        for idx in sampler:
            while state.step in holds and not os.path.exists(holds[state.step]):
                time.sleep(0.05)
            if (state.step == KILL_AT and rank == 1
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data[idx]), target[idx])
            loss.backward()
            opt.step()
            sched.step()
            state.step += 1
            if rank == 0:
                print(f"DONE step {state.step} world {world}", flush=True)
            time.sleep(PAUSE)
            state.commit()
        state.epoch = epoch + 1
    [p.detach().clone() for p in model.module.parameters()]
""")
STEPS = 40


def train(log_dir, recorder, *, nproc=2, kill_at=-1, resizes=(), **spec_args):
    pause = 0.05 if resizes else 0.0
    spec = JobSpec.create(nproc, log_dir=log_dir, **spec_args)
    payload = build_payload(TRAIN, spec, namespace={"KILL_AT": kill_at, "PAUSE": pause})
    job = Job(spec, payload).start()

    return run_resized(job, recorder, resizes)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    from conftest import Recorder

    recorder = Recorder()
    result = train(tmp_path_factory.mktemp("logs"), recorder)
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    # Each commit says where the ElasticSampler is (12 samples a step), for samples/s.
    assert [(e.step, e.samples) for e in recorder.of(Committed)] == [
        (step, 12 * step) for step in range(1, STEPS + 1)]
    return result.values[0]


def assert_same_parameters(params, expected, atol):
    assert len(params) == len(expected)
    for got, want in zip(params, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=atol)


def committed_steps(recorder) -> list[int]:
    return [e.step for e in recorder.of(Committed)]


def starts_from_the_last_commit(recorder) -> list[tuple[int, int]]:
    """Rank 0's (step, world size) at each start; each start is at the last commit the
    agent had whole before it."""
    committed, starts = 0, []
    for event in recorder.events:
        if isinstance(event, Committed):
            committed = event.step
        elif isinstance(event, Output) and event.rank == 0 and event.stream == "stdout":
            for line in event.lines:
                if line.startswith("START"):
                    _, _, step, _, world = line.split()
                    assert int(step) == committed, (line, committed)
                    starts.append((int(step), int(world)))
    return starts


@pytest.mark.parametrize("survivors", [False, True], ids=["restart", "survivors-stay"])
def test_killed_worker_resumes_from_last_commit(baseline, log_dir, recorder, survivors):
    result = train(log_dir, recorder, kill_at=7, max_restarts=1, survivors=survivors)
    assert result.restarts == 1 and result.failures == []
    # Survivors stay: rank 0 went on in its own process; only rank 1 started again.
    assert_stayed(recorder, [(0,)] if survivors else [()])
    # The restarted group started from the commit of step 7, the one before the kill.
    assert "START step 7 world 2" in recorder.lines(0)
    assert done_steps(recorder) == list(range(1, STEPS + 1))  # none twice, none skipped
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=0)  # same size: bit for bit


@pytest.mark.parametrize("survivors", [False, True], ids=["restart", "survivors-stay"])
def test_resize_two_three_one_matches_uninterrupted(baseline, log_dir, recorder, survivors):
    result = train(log_dir, recorder, resizes=((5, 3), (18, 1)), min_nproc=1, max_nproc=3,
                   survivors=survivors)
    assert result.restarts == 0 and result.resizes == 2
    # Survivors stay: 2 -> 3 kept ranks 0 and 1 (rank 2 started), 3 -> 1 kept rank 0.
    assert_stayed(recorder, [(0, 1), (0,)] if survivors else [(), ()])
    worlds = [int(line.split()[4]) for line in recorder.lines(0) if line.startswith("DONE")]
    assert worlds[0] == 2 and 3 in worlds and worlds[-1] == 1
    assert worlds == sorted(worlds, key=[2, 3, 1].index), "sizes went 2, then 3, then 1"
    assert done_steps(recorder) == list(range(1, STEPS + 1))  # no step run twice or lost
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    requested = recorder.of(ResizeRequested)
    assert [r.target for r in requested] == [3, 1] and all(r.graceful for r in requested)
    changes = [(m.old_nproc, m.new_nproc) for m in recorder.of(MembershipChanged)]
    assert changes == [(2, 3), (3, 1)]
    # Different world sizes sum the same global batch in another order: float rounding.
    assert_same_parameters(result.values[0], baseline, atol=1e-5)


def test_a_slot_that_fails_again_is_excluded_and_the_job_goes_on_smaller(
        baseline, log_dir, recorder):
    # Slot 1 (GPU 1, here the second CPU worker) fails from step 5 on, whatever its rank.
    fail = ('        if os.environ["ELASTIC_MAGIC_SLOT"] == "1" and state.step >= 5:\n'
            '            os._exit(3)\n')
    broken = TRAIN.replace("        opt.zero_grad()", fail + "        opt.zero_grad()")
    assert broken != TRAIN
    spec = JobSpec.create(3, log_dir=log_dir, min_nproc=1, max_restarts=1)
    payload = build_payload(broken, spec, namespace={"KILL_AT": -1, "PAUSE": 0.0})
    result = Job(spec, payload).start().wait(recorder)
    assert result.ok, result
    # It failed, was restarted (1/1), failed again: left out, and the job went on with 2.
    assert result.restarts == 1 and result.world_size == 2
    assert [(m.old_nproc, m.new_nproc) for m in recorder.of(MembershipChanged)] == [(3, 2)]
    (excluded,) = recorder.of(Excluded)
    assert excluded.what == "slot 1 of this machine" and excluded.goes_on
    assert "failed again after a restart" in excluded.why and "code 3" in excluded.why
    assert "slot 1 of this machine excluded" in describe(excluded).text
    assert result.excluded == [f"slot 1 of this machine: {excluded.why}"]
    assert "went on without slot 1" in result.summary()
    # From the last whole commit each time (the failure may come while the commit of step
    # 5 is still sent behind the training: then from step 4's): the world went 3 -> 2. The
    # restarted group of 3 may end before rank 0 says where it starts: slot 1 fails at its
    # first step, before any collective, while rank 0 may still be restoring.
    starts = starts_from_the_last_commit(recorder)
    assert starts[0] == (0, 3) and [world for _, world in starts] in ([3, 3, 2], [3, 2])
    assert all(step in (4, 5) for step, _ in starts[1:])
    done = done_steps(recorder)  # every step, and again only what a restart rolled back
    assert sorted(set(done)) == list(range(1, STEPS + 1))
    assert len(done) == STEPS + sum(5 - step for step, _ in starts[1:])
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)


def test_immediate_resize_without_state_restarts_the_cell(log_dir, recorder):
    spec = JobSpec.create(1, log_dir=log_dir, max_nproc=2)
    cell = ("import time, torch.distributed as dist\n"
            "print('size', dist.get_world_size(), flush=True)\n"
            "if dist.get_world_size() == 1:\n    time.sleep(600)\n")
    job = Job(spec, build_payload(cell, spec)).start()

    def drive():
        while not any("size 1" in line for line in recorder.lines(0)):
            threading.Event().wait(0.05)
        job.scale(2)

    threading.Thread(target=drive, daemon=True).start()
    result = job.wait(recorder)
    assert result.ok and result.world_size == 2 and result.restarts == 0
    assert [r.graceful for r in recorder.of(ResizeRequested)] == [False]


def test_scale_outside_bounds_is_refused(log_dir):
    spec = JobSpec.create(2, log_dir=log_dir, min_nproc=2, max_nproc=3)
    job = Job(spec, build_payload("x = 1", spec))
    with pytest.raises(SpecError, match="between 2 and 3 workers"):
        job.scale(4)
    with pytest.raises(SpecError, match="--min-nproc/--max-nproc"):
        job.scale(1)


def test_checkpoint_dir_survives_the_job(tmp_path, log_dir, recorder):
    ckpt = tmp_path / "ckpt"
    first = train(log_dir, recorder, checkpoint_dir=ckpt)
    assert (ckpt / "checkpoint.em").exists() and first.commit["step"] == STEPS
    assert not list(ckpt.glob(".*"))  # no half-written temporary left
    from conftest import Recorder

    again = Recorder()
    second = train(log_dir, again, checkpoint_dir=ckpt)
    assert "START step 40 world 2" in again.lines(0)  # resumed, nothing left to train
    assert done_steps(again) == []
    assert_same_parameters(second.values[0], first.values[0], atol=0)


def test_state_outside_a_job_keeps_working():
    model = torch.nn.Linear(2, 1)
    state = em.State(model=model, step=0)
    state.step += 1
    state.commit()  # nothing to send it to: still a plain object
    blob = state.snapshot()
    other = em.State(model=torch.nn.Linear(2, 1), step=0)
    other.load(blob)
    assert other.step == 1
    torch.testing.assert_close(other.model.weight, model.weight)
    with pytest.raises(AttributeError, match="State has no value 'epochs'"):
        _ = state.epochs


@pytest.mark.parametrize("refuse", ["never", "worker_cannot_open", "agent_cannot_read"])
def test_snapshots_reach_the_agent_through_memory_files_or_the_pipe(log_dir, recorder, refuse):
    """Commits are written into the agent's memory file for them, opened through /proc;
    where the worker cannot open it, into a memory file of the worker's that the agent
    reads through /proc; when the agent cannot read that either, down the pipe; and the
    worker keeps to the route that worked."""
    cell = textwrap.dedent("""
        import os, torch, elastic_magic
        import elastic_magic.training.handoff as state_module
        if REFUSE != "never":  # as if the agent's file could not be opened here
            state_module._write_into = lambda *args: False
        if REFUSE == "agent_cannot_read":
            os.getpid = lambda: 1  # the agent only reads memory files of its own workers
        model = torch.nn.Linear(300, 300)
        state = elastic_magic.State(model=model, step=0)
        for _ in range(3):
            state.step += 1
            state.commit()
        print("target", state_module._TARGET, "handoff", state_module._HANDOFF, flush=True)
        model.weight.sum().item()
    """)
    result = em.launch(cell, nproc=1, namespace={"REFUSE": refuse}, log_dir=log_dir,
                       render=recorder)
    assert committed_steps(recorder) == [1, 2, 3]
    assert recorder.lines(0) == [f"target {refuse == 'never'} "
                                 f"handoff {refuse != 'agent_cannot_read'}"]
    snapshot = snapshot_format.load(io.BytesIO(result.snapshot))
    assert snapshot["values"]["step"] == 3
    weight = snapshot["objects"]["model"]["weight"]
    assert weight.sum().item() == pytest.approx(result.values[0], abs=1e-4)


def test_random_kills_with_survivors_staying_end_bit_for_bit(baseline, log_dir, recorder):
    """Chaos, small: six SIGKILLs of either rank's worker at random moments (in a step,
    in a commit, while the group starts); the survivor stays each time, and the training
    ends at the uninterrupted parameters, bit for bit."""
    import os
    import random
    import signal
    import time

    import psutil

    from elastic_magic.wire.events import WorkersStarted

    spec = JobSpec.create(2, log_dir=log_dir, max_restarts=8, survivors=True)
    payload = build_payload(TRAIN, spec, namespace={"KILL_AT": -1, "PAUSE": 0.1})
    job = Job(spec, payload).start()
    rng, killed = random.Random(7), []

    def groups_started(at_least):
        deadline = time.monotonic() + 60
        while len(recorder.of(WorkersStarted)) < at_least and not job.done \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        return recorder.of(WorkersStarted)

    def chaos():
        for kill in range(6):
            groups_started(kill + 1)  # each kill hits the next group
            time.sleep(rng.uniform(0.2, 1.0))
            if job.done:
                return
            rank_shepherd = psutil.Process(rng.choice(groups_started(kill + 1)[-1].pids))
            worker = rank_shepherd.children()  # the rank itself, below its shepherd
            if worker:
                os.kill(worker[0].pid, signal.SIGKILL)
                killed.append(worker[0].pid)

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    result = job.wait(recorder)
    thread.join(timeout=60)
    assert result.ok, result
    assert len(killed) >= 4 and result.restarts == len(killed)
    stayed = [s.stayed for s in recorder.of(WorkersStarted)[1:]]
    # one rank killed, the other stayed, each time
    assert all(len(s) == 1 for s in stayed), (stayed, [
        (f.rank, f.reason, f.exc_type) for f in (e.failure for e in recorder.of(WorkerFailed))])
    assert committed_steps(recorder)[-1] == STEPS
    assert_same_parameters(result.values[0], baseline, atol=0)
