"""A sharded State: an FSDP2 model (``fully_shard`` on each Linear, then the model) and its
Adam optimizer, trained by real gloo workers with commits. Each rank commits its own
chunks; a rank killed between commits replays to the same parameters bit for bit; resized
2 -> 3 -> 2 (64 rows over 3 ranks: 22, 22, 20; a 1-row weight: 1, 0, 0) it ends within
float tolerance of the uninterrupted run, every step once; layouts State cannot restore
(tensor parallelism, a 2-D mesh) are refused at State(...). Two ranks share the CPU over gloo,
also on a GPU machine (tests/test_gpu_sharded.py runs FSDP2 on CUDA over NCCL)."""

from __future__ import annotations

import signal
import textwrap
import time

import psutil
import pytest
import torch
from conftest import assert_stayed, done_steps, run_resized
from test_multinode import Machines, run_head

import elastic_magic as em
from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.training import sharded, snapshot_format
from elastic_magic.wire.events import Committed, Excluded, MembershipChanged, RendezvousCompleted
from elastic_magic.wire.payload import build_payload

TRAIN = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import elastic_magic, elastic_magic.worker.client

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(240, 8, generator=g)
    target = torch.sin(data.sum(1, keepdim=True))
    sampler = elastic_magic.ElasticSampler(len(data), global_batch_size=12, seed=0)
    state = elastic_magic.State(model=model, optimizer=opt, sampler=sampler, step=0, epoch=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"START step {state.step} world {world}", flush=True)
    for epoch in range(state.epoch, 2):
        sampler.set_epoch(epoch)
        for indices in sampler:
            if state.step == KILL_AT and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                # The last commit is in the agent (it is sent behind the training, and two
                # steps can be quicker than that on a loaded machine), and rank 0 has said
                # its step is done, before rank 1 dies.
                elastic_magic.worker.client.current().drain()
                dist.barrier()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            noise = 1 + torch.rand(()) / 10  # the loop's RNG, restored with the commit
            loss = torch.nn.functional.mse_loss(model(data[indices]), target[indices]) * noise
            loss.backward()
            opt.step()
            opt.zero_grad()
            state.step += 1
            if rank == 0:
                print(f"DONE step {state.step} world {world}", flush=True)
            time.sleep(PAUSE)
            state.commit(every=EVERY)
            if (state.step == KILL_AFTER and rank == 1  # its part of the commit in flight
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                os.kill(os.getpid(), signal.SIGKILL)
        state.epoch = epoch + 1
    full = [p.full_tensor().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg_sq"].full_tensor().clone() for p in model.parameters()]
    (full, moments)
""")
STEPS = 40  # 2 epochs of 20 global batches


def train(log_dir, recorder, *, every, nproc=2, kill_at=-1, kill_after=-1, resizes=(),
          **spec_args):
    spec = JobSpec.create(nproc, backend="gloo", log_dir=log_dir, **spec_args)
    namespace = {"KILL_AT": kill_at, "KILL_AFTER": kill_after, "EVERY": every,
                 "PAUSE": 0.05 if resizes else 0.0}
    job = Job(spec, build_payload(TRAIN, spec, namespace=namespace)).start()

    return run_resized(job, recorder, resizes)


def assert_same(got, want, atol):
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from conftest import Recorder

    recorder = Recorder()
    result = train(tmp_path_factory.mktemp("logs"), recorder, every=1)
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert [e.step for e in recorder.of(Committed)] == list(range(1, STEPS + 1))
    return result


@pytest.mark.unit
def test_fsdp2_commits_each_ranks_chunks(uninterrupted):
    """The last commit holds one part per rank, each with its own rows of every tensor."""
    parts = snapshot_format.load_parts(__import__("io").BytesIO(uninterrupted.snapshot))
    assert len(parts) == 2 and parts[0]["world_size"] == 2
    tree = parts[0]["objects"]["model"]
    marker = tree["0.weight"]
    assert isinstance(marker, sharded.ShardedTensor) and marker.shape == (64, 8)
    rows = {i: part["chunks"][("model", "0.weight")] for i, part in enumerate(parts)}
    assert [(first, tuple(chunk.shape)) for first, chunk in rows.values()] == [
        (0, (32, 8)), (32, (32, 8))]
    moment = parts[0]["objects"]["optimizer"]["state"][0]["exp_avg"]
    assert isinstance(moment, sharded.ShardedTensor) and not moment.replicated
    # The kernel reads the result into a plain model: whole tensors.
    plain = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    em.State(model=plain).load(uninterrupted.snapshot)
    final = uninterrupted.values[0][0]
    for got, want in zip(plain.parameters(), final, strict=True):
        assert torch.equal(got.detach(), want)


@pytest.mark.parametrize("survivors", [False, True], ids=["restart", "survivors-asked"])
def test_a_rank_killed_between_commits_replays_bit_for_bit(uninterrupted, log_dir, recorder,
                                                           survivors):
    result = train(log_dir, recorder, every=5, kill_at=12, max_restarts=1,
                   survivors=survivors)
    assert_stayed(recorder, [(0,) if survivors else ()])  # rank 0 stays, in its process
    # the commit before the kill
    assert "START step 10 world 2" in recorder.lines(0), "\n".join(
        [recorder.story(), "rank 0's output:", *recorder.lines(0)])
    assert done_steps(recorder) == list(range(1, 13)) + list(range(11, STEPS + 1))
    assert_same(result.values[0], uninterrupted.values[0], atol=0)


def test_a_rank_killed_while_its_part_is_sent_resumes_from_a_whole_commit(uninterrupted,
                                                                         log_dir, recorder):
    """Commits are sent behind the training: a rank killed just after commit() returned
    leaves the commit whole (its part arrived) or absent (the one before is restored)."""
    result = train(log_dir, recorder, every=5, kill_after=10, max_restarts=1)
    resumed = [line for line in recorder.lines(0) if line.startswith("START")][1]
    step = int(resumed.split()[2])
    assert step in (5, 10), resumed
    assert done_steps(recorder) == list(range(1, 11)) + list(range(step + 1, STEPS + 1))
    assert_same(result.values[0], uninterrupted.values[0], atol=0)


@pytest.mark.parametrize("sizes,survivors", [(((5, 3), (20, 2)), False),
                                             (((5, 1), (15, 3)), False),
                                             (((5, 3), (20, 2)), True)],
                         ids=["2-3-2", "2-1-3", "2-3-2-survivors-stay"])
def test_resized_fsdp2_reshards_and_ends_near_the_uninterrupted_run(uninterrupted, log_dir,
                                                                    recorder, sizes,
                                                                    survivors):
    result = train(log_dir, recorder, every=5, resizes=sizes, min_nproc=1, max_nproc=3,
                   survivors=survivors)
    assert [(m.old_nproc, m.new_nproc) for m in recorder.of(MembershipChanged)] == [
        (2, sizes[0][1]), (sizes[0][1], sizes[1][1])]
    if survivors:  # every rank of the smaller group stays through both resizes
        assert_stayed(recorder, [(0, 1), (0, 1)])
    assert done_steps(recorder) == list(range(1, STEPS + 1))  # every step once
    # Other world sizes reduce the gradients in another order: float rounding only.
    assert_same(result.values[0], uninterrupted.values[0], atol=1e-5)


REFUSED = textwrap.dedent("""
    import torch, elastic_magic
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    if LAYOUT == "tensor parallel":
        parallelize_module(model, init_device_mesh("cpu", (2,)), {"0": RowwiseParallel()})
    else:  # HSDP: replicate over 1, shard over 2
        fully_shard(model, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("r", "s")))
    elastic_magic.State(model=model, step=0)
""")


@pytest.mark.parametrize("layout,why", [("tensor parallel", "placements (Shard(dim=1),)"),
                                        ("2-D mesh", "a 2-D device mesh")])
def test_layouts_state_cannot_restore_are_refused_at_state(log_dir, layout, why):
    with pytest.raises(em.JobFailedError) as failed:
        em.launch(REFUSED, nproc=2, backend="gloo", log_dir=log_dir,
                  namespace={"LAYOUT": layout},
                  render=lambda e: None)
    error = failed.value.result.failure
    assert error.exc_type == "Unsupported", error
    assert why in error.message and "State supports DTensors" in error.message
    assert "1-D device mesh" in error.message and "torch.distributed.checkpoint" in error.message


@pytest.mark.unit
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 64])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_rows_are_dealt_as_torch_chunk_deals_them(rows, ranks):
    chunks = torch.arange(rows).chunk(ranks) if rows else ()
    want = [len(c) for c in chunks] + [0] * (ranks - len(chunks))
    got = [end - start for start, end in (sharded._rows(rows, r, ranks) for r in range(ranks))]
    assert got == want
    assert [sharded._rows(rows, r, ranks)[0] for r in range(ranks)] == sorted(
        sharded._rows(rows, r, ranks)[0] for r in range(ranks))


def test_a_checkpoint_of_two_ranks_resumes_on_three(uninterrupted, tmp_path, log_dir,
                                                   recorder):
    """--checkpoint-dir holds every rank's chunks: a job of another size resumes from it,
    its parameters and moments exactly the committed ones."""
    from conftest import Recorder

    ckpt = tmp_path / "ckpt"
    first = train(log_dir, recorder, every=5, checkpoint_dir=ckpt)
    again = Recorder()
    second = train(log_dir, again, every=5, checkpoint_dir=ckpt, nproc=3)
    assert f"START step {STEPS} world 3" in again.lines(0)  # nothing left to train
    assert_same(second.values[0], first.values[0], atol=0)


@pytest.fixture
def machines(tmp_path):
    found = Machines(tmp_path)
    yield found
    found.reap()


def test_chunks_of_ranks_on_another_machine_cross_to_the_head(uninterrupted, machines,
                                                             log_dir, recorder):
    """A machine that joined sends its ranks' parts through its agent to the head, which
    holds the commit; a resize to 3 ranks on 2 machines reshards from them."""
    spec = JobSpec.create(1, nnodes=2, max_nproc=2, backend="gloo", log_dir=log_dir,
                          timeout=120)

    def drive(job):
        job.wait_for_commit(10, timeout=120)
        job.scale(2)

    result = run_head(spec, TRAIN, recorder, machines, drive=drive,
                      namespace={"KILL_AT": -1, "KILL_AFTER": -1, "EVERY": 5,
                                 "PAUSE": 0.05},
                      on_open=lambda: machines.join(1))
    assert result.ok, result
    assert machines.procs[0].wait(timeout=30) == 0, machines.output(0)
    assert "rendezvous round 2: world size 3 on 2 machines" in machines.output(0)
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert_same(result.values[0], uninterrupted.values[0], atol=1e-5)


FROM_WHOLE = textwrap.dedent("""
    import torch, torch.distributed as dist, elastic_magic
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    elastic_magic.State(model=model, optimizer=opt).load(BLOB)
    loaded = [p.full_tensor().clone() for p in model.parameters()]
    mine = slice(dist.get_rank() * 6, dist.get_rank() * 6 + 6)
    torch.nn.functional.mse_loss(model(X[mine]), Y[mine]).backward()  # half the batch each
    opt.step()
    (loaded, [p.full_tensor().clone() for p in model.parameters()])
""")


def test_a_commit_of_a_whole_model_restores_into_fsdp2(log_dir):
    """A snapshot of an unsharded model and its Adam (DDP's, or a single process's) is
    sharded as it is restored into an FSDP2 model: the same parameters, and the next Adam
    step (its moments restored as DTensors) that the unsharded model takes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(12, 8), torch.randn(12, 1)
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    blob = em.State(model=model, optimizer=opt).snapshot()
    before = [p.detach().clone() for p in model.parameters()]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    result = em.launch(FROM_WHOLE, nproc=2, backend="gloo", log_dir=log_dir,
                       render=lambda e: None,
                       namespace={"BLOB": blob, "X": x, "Y": y})
    loaded, stepped = result.values[0]
    for got, want in zip(loaded, before, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(stepped, model.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)


@pytest.mark.unit
def test_a_restoring_rank_reads_only_the_parts_holding_its_rows():
    """Committed by 3 ranks (rows 0-2, 3-5, 6-8 of a 9-row tensor), restored by rank 0 of
    2 (rows 0-4): parts 0 and 1 are read, not part 2; restored whole: all three."""
    marker = sharded.ShardedTensor(("model", "w"), (9, 2), "float32", replicated=False)
    whole = torch.arange(18.0).reshape(9, 2)
    parts = {i: {"chunks": {marker.key: (3 * i, whole[3 * i:3 * i + 3])}} for i in range(3)}
    read: list[int] = []

    def part(i):
        read.append(i)
        return parts[i]

    chunks = sharded.Chunks(part, 3)
    assert torch.equal(sharded._assemble(marker, chunks, 0, 5), whole[:5]) and read == [0, 1]
    read.clear()
    assert torch.equal(sharded._assemble(marker, chunks, 0, 9), whole) and read == [0, 1, 2]
    read.clear()
    assert sharded._assemble(marker, chunks, 9, 9).shape == (0, 2) and read == []
    del parts[2]  # a part that lacks rows is never restored from what is left
    with pytest.raises(RuntimeError, match="lacks rows"):
        sharded._assemble(marker, sharded.Chunks(lambda i: parts.get(i, {}), 3), 0, 9)


def test_a_joined_machine_lost_mid_run_resumes_from_its_chunks_copy_on_the_head(
        uninterrupted, machines, log_dir, recorder):
    """The machine that joined keeps its rank's chunks and the head a copy of them. Its
    agent SIGKILLed mid-run (its link closes without notice), the head goes on alone from
    the last commit, the lost rank's chunks taken from the head's copy: no commit lost,
    and the uninterrupted run's parameters."""
    spec = JobSpec.create(1, nnodes="1:2", backend="gloo", log_dir=log_dir, timeout=120,
                          link_timeout=3)
    seen: dict[str, int] = {}

    def drive(job):
        while not any(r.world_size == 2 for r in recorder.of(RendezvousCompleted)):
            if job.done:
                return
            time.sleep(0.05)
        first = job.last_commit["step"] if job.last_commit else 0
        job.wait_for_commit(first + 3, timeout=120)
        seen["committed"] = job.last_commit["step"]  # whole: every rank's chunk is in
        psutil.Process(machines.procs[0].pid).send_signal(signal.SIGKILL)  # ours, by PID

    result = run_head(spec, TRAIN, recorder, machines, drive=drive,
                      namespace={"KILL_AT": -1, "KILL_AFTER": -1, "EVERY": 1, "PAUSE": 0.4},
                      on_open=lambda: machines.join(1))
    assert result.ok, result
    worlds = [(r.world_size, r.nnodes) for r in recorder.of(RendezvousCompleted)]
    assert (2, 2) in worlds and worlds[-1] == (1, 1), worlds
    (lost,) = recorder.of(Excluded)
    assert "closed without notice" in lost.why, lost.why
    starts = [int(line.split()[2]) for line in recorder.lines(0) if line.startswith("START")]
    assert starts[-1] >= seen["committed"], (starts, seen)  # no commit lost
    assert sorted({e.step for e in recorder.of(Committed)}) == list(range(1, STEPS + 1))
    assert_same(result.values[0], uninterrupted.values[0], atol=1e-5)


BIG = textwrap.dedent("""
    import os, time, torch, elastic_magic
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(12)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    state = elastic_magic.State(model=model, step=0)
    while state.step < 8:
        state.step += 1
        state.commit()
        time.sleep(PAUSE)
    while not os.path.exists(MEASURED):  # the test has read the kernel's peak
        time.sleep(0.05)
    state.step
""")
BIG_BYTES = 12 * 2048 * 2048 * 4  # 201 MB of parameters


def _kernel_kb(field: str) -> int:
    """This process's (the kernel's: the head's agent runs in it) VmRSS or VmHWM."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def test_the_kernel_holds_none_of_the_models_bytes(machines, log_dir, recorder, tmp_path):
    """A State of a ~200 MB FSDP2 model on 2 machines, committed every step and restored
    once on 3 ranks (a resize): the other machine's chunks cross to the head and back in
    pieces, into memory files, so the kernel's peak RSS grows by well under the model's
    size (measured from the first commit to the last, once the job's imports are done)."""
    spec = JobSpec.create(1, nnodes=2, max_nproc=2, backend="gloo", log_dir=log_dir,
                          timeout=180)
    rss: dict[str, int] = {}

    def drive(job):
        try:
            job.wait_for_commit(1, timeout=180)
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # VmHWM: the peak from now on
            rss["before"] = _kernel_kb("VmRSS")
            job.wait_for_commit(3, timeout=180)
            job.scale(2)
            job.wait_for_commit(8, timeout=180)
            rss["peak"] = _kernel_kb("VmHWM")
        finally:
            measured.touch()  # the cell ends

    measured = tmp_path / "measured"
    result = run_head(spec, BIG, recorder, machines, drive=drive,
                      namespace={"PAUSE": 0.2, "MEASURED": str(measured)},
                      on_open=lambda: machines.join(1))
    assert result.ok, result
    assert machines.procs[0].wait(timeout=60) == 0, machines.output(0)
    assert [(r.world_size, r.nnodes) for r in recorder.of(RendezvousCompleted)] == [
        (2, 2), (3, 2)]
    assert [e.step for e in recorder.of(Committed)][-1] == 8
    growth = (rss["peak"] - rss["before"]) * 1024
    print(f"kernel RSS {rss['before'] / 1024:.0f} MB, peak growth {growth / 2**20:.1f} MB "
          f"for a State of {BIG_BYTES / 2**20:.0f} MB")
    assert growth < BIG_BYTES / 4, growth  # main before chunks: 288 MB
