"""Commits: the snapshot format round-trips what a State holds, and a commit is atomic: a
rank that dies in the middle of one leaves the previous commit whole, in the agent and in
the checkpoint folder."""

from __future__ import annotations

import io
import textwrap

import pytest
import torch

import elastic_magic as em
from elastic_magic.agent.node.snapshots import split_checkpoint
from elastic_magic.training import snapshot_format


@pytest.mark.unit
def test_the_format_round_trips_tensors_of_every_kind_and_reads_torch_save():
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    shared = torch.arange(6.0)
    data = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "odd": [torch.tensor(True), torch.zeros(0, 3), torch.arange(6).reshape(2, 3).t(),
                    torch.randn(3, dtype=torch.complex64), torch.ones(2, dtype=torch.bfloat16),
                    torch.randn(4).to_sparse(), shared, shared],
            "plain": {"step": 7, "name": "run"}}
    for writer in (snapshot_format.save, torch.save):
        buffer = io.BytesIO()
        writer(data, buffer)
        buffer.seek(0)
        back = snapshot_format.load(buffer)
        torch.testing.assert_close(back["model"], data["model"], rtol=0, atol=0)
        torch.testing.assert_close(back["optimizer"]["state"], data["optimizer"]["state"],
                                   rtol=0, atol=0)
        for ours, theirs in zip(back["odd"], data["odd"], strict=True):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            assert torch.equal(ours.to_dense(), theirs.to_dense())
        assert back["plain"] == data["plain"]
    whole = io.BytesIO()
    snapshot_format.save(data, whole)
    with pytest.raises(EOFError, match="ends inside a tensor"):
        snapshot_format.load(io.BytesIO(whole.getvalue()[:-10]))


@pytest.mark.unit
def test_a_prepared_snapshot_is_a_copy_that_training_cannot_change():
    """What a commit blocks for: the tree pickled and the tensors copied; the write happens
    later, while training changes the tensors in place."""
    model = torch.nn.Linear(16, 8)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    data = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "view": model.weight.t()[2:5]}
    want = io.BytesIO()
    snapshot_format.save(data, want)
    prepared = snapshot_format.prepare(data)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()  # parameters, moments and the step counter change in place
    before = snapshot_format.load(io.BytesIO(want.getvalue()))
    assert not torch.equal(model.weight, before["model"]["weight"])
    assert optimizer.state_dict()["state"][0]["step"] == 2 != before["optimizer"]["state"][0][
        "step"]
    written = io.BytesIO()
    prepared.write(written)
    assert written.getvalue() == want.getvalue()
    # The next commit copies into the memory of this one, once it is written.
    data = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "view": model.weight.t()[2:5]}
    again = snapshot_format.prepare(data, reuse=prepared)
    assert {b.data_ptr() for b in again.flat} == {b.data_ptr() for b in prepared.flat}
    want, written = io.BytesIO(), io.BytesIO()
    snapshot_format.save(data, want)
    again.write(written)
    assert written.getvalue() == want.getvalue()


CRASH = textwrap.dedent("""
    import os, signal, torch, elastic_magic

    class DiesWhenPickled:  # the rank dies in the middle of writing its snapshot
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGKILL)

    model = torch.nn.Linear(64, 64)
    state = elastic_magic.State(model=model, step=0, doomed=None)
    for step in (1, 2):
        state.step = step
        with torch.no_grad():
            model.weight.fill_(step)
        if step == 2:
            state.doomed = DiesWhenPickled()
        state.commit()
""")


def test_a_rank_that_dies_mid_commit_leaves_the_previous_commit_whole(tmp_path, log_dir):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(em.JobFailedError) as failed:
        em.launch(CRASH, nproc=1, checkpoint_dir=ckpt, log_dir=log_dir,
                  render=lambda e: None)
    result = failed.value.result
    assert result.failure.signal == "SIGKILL" and result.commit["step"] == 1
    meta, on_disk = split_checkpoint((ckpt / "checkpoint.em").read_bytes())
    assert meta["step"] == 1
    for blob in (result.snapshot, on_disk):
        snapshot = snapshot_format.load(io.BytesIO(blob))
        assert snapshot["values"]["step"] == 1
        assert torch.all(snapshot["objects"]["model"]["weight"] == 1)
    assert not list(ckpt.glob(".*"))  # no half-written temporary left


AFTER_COMMIT = textwrap.dedent("""
    import os, signal, time, torch.distributed as dist
    import elastic_magic
    from elastic_magic.training import handoff

    send = handoff.send

    def slow_send(client, prepared, commit):  # a large snapshot: it takes a while to send
        if commit.keywords["step"] == 2:
            time.sleep(0.5)
        send(client, prepared, commit)

    handoff.send = slow_send
    state = elastic_magic.State(step=0)
    print("start", state.step)
    while state.step < 3:
        state.step += 1
        state.commit()
        if state.step == 2 and dist.get_rank() == 1 \\
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # every rank has made the commit of step 2
        dist.barrier()  # rank 0 learns of the death here, while its commit is on its way
    state.step
""")


def test_a_rank_that_dies_right_after_a_commit_resumes_from_that_commit(log_dir, recorder):
    """Rank 1 dies as soon as a commit returns; rank 0 is still sending it (behind its
    training), and fails in the next collective. The agent knows of the death at once, and
    rank 0 of its failure, but the commit lands before rank 0 ends and before the teardown:
    the restart resumes from it, not from the one before."""
    result = em.launch(AFTER_COMMIT, nproc=2, max_restarts=1, log_dir=log_dir,
                       render=recorder)
    assert result.restarts == 1 and result.failures == []
    assert recorder.lines(0) == ["start 0", "start 2"]
    assert result.values == {0: 3, 1: 3} and result.commit["step"] == 3


def test_a_results_snapshot_stays_in_the_memory_file_until_it_is_read(log_dir):
    """The kernel keeps every finished job's result: its snapshot (the whole state) stays in
    the agent's memory file, out of the heap, and reads the same each time it is asked for;
    the ended job the kernel's history keeps drops it."""
    import gc

    from elastic_magic.agent.handles.ended import EndedJob
    from elastic_magic.agent.handles.job import Job
    from elastic_magic.result import MemorySnapshot
    from elastic_magic.spec import JobSpec
    from elastic_magic.wire.payload import build_payload

    cell = ("import torch, elastic_magic\n"
            "state = elastic_magic.State(model=torch.nn.Linear(256, 256), step=3)\n"
            "state.commit()\n")
    spec = JobSpec.create(1, log_dir=log_dir)
    job = Job(spec, build_payload(cell, spec)).start()
    result = job.wait(lambda events: None)
    assert result.ok, result
    kept = result.snapshot_source
    assert isinstance(kept, MemorySnapshot) and kept.size > 256 * 256 * 4
    first = result.snapshot
    assert first == result.snapshot and len(first) == kept.size
    assert snapshot_format.load(io.BytesIO(first))["values"]["step"] == 3
    assert EndedJob.of(job).result.snapshot is None
    closed = kept._finalizer
    del result, kept, job
    gc.collect()
    assert not closed.alive  # its memory file was closed with the last reference to it


@pytest.mark.unit
def test_random_states_cross_ranks_as_a_fixed_layout_never_a_pickle():
    """Each rank's RNG states reach rank 0 over gloo/NCCL, which nobody authenticates: they
    go as bytes of one layout, decoded field by field. A round trip restores every stream
    exactly; a pickle (or anything else a peer might send) is refused, never loaded."""
    import pickle
    import random

    import numpy

    from elastic_magic.training import rng

    random.seed(3)
    random.gauss(0, 1)  # leaves Python's gauss_next set
    numpy.random.seed(4)
    numpy.random.standard_normal()  # leaves numpy's cached gaussian set
    torch.manual_seed(5)
    saved = rng.current()
    blob = rng.encode(saved)
    assert len(blob) == rng.SIZE
    expected = (random.random(), random.gauss(0, 1), float(numpy.random.standard_normal()),
                torch.rand(3))
    random.seed(0), numpy.random.seed(0), torch.manual_seed(0)
    rng.apply(rng.decode(blob))
    assert (random.random(), random.gauss(0, 1)) == expected[:2]
    assert float(numpy.random.standard_normal()) == expected[2]
    assert torch.equal(torch.rand(3), expected[3])

    class Planted:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    forged = pickle.dumps(Planted()).ljust(rng.SIZE, b"\0")
    with pytest.raises(ValueError, match="not a random-state record"):
        rng.decode(forged)
    with pytest.raises(ValueError, match="bytes, not"):
        rng.decode(blob[:-1])


@pytest.mark.unit
def test_no_module_unpickles_what_a_collective_received():
    """torch's object collectives unpickle what any peer sends: the package calls none."""
    import ast
    from pathlib import Path

    unpickling = {"all_gather_object", "gather_object", "broadcast_object_list",
                  "scatter_object_list", "send_object_list", "recv_object_list"}
    package = Path(em.__file__).parent
    users = [str(p.relative_to(package)) for p in package.rglob("*.py")
             for node in ast.walk(ast.parse(p.read_text()))
             if (isinstance(node, ast.Attribute) and node.attr in unpickling)
             or (isinstance(node, ast.Name) and node.id in unpickling)]
    assert not users, f"object collectives in {users}"
