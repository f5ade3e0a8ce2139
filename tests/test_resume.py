"""Exact resume in a real training loop: batches through elastic_magic.DataLoader with 2
worker processes, prefetching and random augmentations, gradient accumulation, a
GradScaler, an EMA, random numbers from torch, python and numpy, commits every 5 steps.
Uninterrupted, with a rank killed between two commits, and resized 2 -> 3 -> 1, the
training ends with the same parameters; the DistributedSampler switch hands every sample
out once per epoch across a resize."""

from __future__ import annotations

import io
import random
import textwrap
import threading

import numpy
import pytest
import torch
from conftest import assert_stayed, done_steps, run_resized
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import IterableDataset, TensorDataset

import elastic_magic as em
from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.events import Committed, MembershipChanged
from elastic_magic.wire.payload import build_payload

# The acceptance training of test_elastic (40 optimizer steps, each of 2 accumulated global
# batches of 12), fed by a DataLoader (2 workers, prefetching, persistent) whose dataset adds
# random noise (torch, python and numpy RNGs in the workers), with a GradScaler whose scale
# grows every 3 steps, an EMA of the model, and a loss weight drawn for each batch from the
# loop's torch, python and numpy RNGs (the same on every rank and at every world size, so
# resized runs can match too).
TRAIN = textwrap.dedent("""
    import os, random, signal, time, numpy, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    import elastic_magic, elastic_magic.worker.client

    torch.manual_seed(0); random.seed(0); numpy.random.seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DDP(net)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(480, 8, generator=g)
    target = torch.sin(data.sum(1, keepdim=True))

    class Augmented(torch.utils.data.Dataset):  # random draws in the DataLoader's workers
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            noise = torch.randn(8) * random.random() * (1 + numpy.random.rand())
            return data[i] + 0.01 * noise, target[i]

    dataset = Augmented()
    sampler = elastic_magic.ElasticSampler(len(dataset), global_batch_size=12, seed=0)
    loader = elastic_magic.DataLoader(dataset, batch_sampler=sampler, num_workers=2,
                                      prefetch_factor=2, persistent_workers=True)
    state = elastic_magic.State(model=model, optimizer=opt, scheduler=sched, loader=loader,
                                scaler=scaler, ema=ema, step=0, epoch=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"START step {state.step} world {world}", flush=True)
    for epoch in range(state.epoch, 2):
        sampler.set_epoch(epoch)
        for micro, (x, y) in enumerate(loader):  # 2 micro-batches per optimizer step
            if (state.step == KILL_AT and micro % 2  # mid-accumulation
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                # The last commit is in the agent (it is sent behind the training, and two
                # steps can be quicker than that on a loaded machine), and rank 0 has said
                # its step is done, before rank 1 dies.
                elastic_magic.worker.client.current().drain()
                dist.barrier()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            weight = 1 + (torch.rand(()).item() + random.random() + numpy.random.rand()) / 10
            loss = torch.nn.functional.mse_loss(model(x), y) * weight / 2
            scaler.scale(loss).backward()
            if micro % 2 == 0:
                continue
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            sched.step()
            ema.update_parameters(net)
            state.step += 1
            if rank == 0:
                print(f"DONE step {state.step} world {world}", flush=True)
            time.sleep(PAUSE)
            state.commit(every=EVERY)
        state.epoch = epoch + 1
    ([p.detach().clone() for p in net.parameters()],
     [p.detach().clone() for p in ema.parameters()], scaler.get_scale())
""")
STEPS = 40


def train(log_dir, recorder, *, every, kill_at=-1, resizes=(), **spec_args):
    # A hang fails the job within a minute with its stuck ranks' stacks (a DataLoader's
    # workers starting, once in a full run), not pytest's timeout with none.
    spec = JobSpec.create(2, log_dir=log_dir, timeout=60, stall_timeout=60, **spec_args)
    namespace = {"KILL_AT": kill_at, "EVERY": every, "PAUSE": 0.05 if resizes else 0.0}
    job = Job(spec, build_payload(TRAIN, spec, namespace=namespace)).start()

    return run_resized(job, recorder, resizes).values[0]


def committed_steps(recorder) -> list[int]:
    return [e.step for e in recorder.of(Committed)]


def assert_same(got, want, atol):
    (params, ema, scale), (want_params, want_ema, want_scale) = got, want
    assert scale == want_scale and scale > 2.0 ** 8  # the scaler's growth was restored
    for a, b in zip(params + ema, want_params + want_ema, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from conftest import Recorder

    recorder = Recorder()
    values = train(tmp_path_factory.mktemp("logs"), recorder, every=1)
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    return values


@pytest.mark.parametrize("survivors", [False, True], ids=["restart", "survivors-stay"])
def test_rank_killed_between_commits_replays_to_the_same_parameters(uninterrupted, log_dir,
                                                                     recorder, survivors):
    values = train(log_dir, recorder, every=5, kill_at=12, max_restarts=1,
                   survivors=survivors)
    assert_stayed(recorder, [(0,)] if survivors else [()])
    assert "START step 10 world 2" in recorder.lines(0)  # the commit before the kill
    # Steps 11 and 12 ran before the kill and again after it; none was skipped.
    assert done_steps(recorder) == list(range(1, 13)) + list(range(11, STEPS + 1))
    assert committed_steps(recorder) == list(range(5, STEPS + 1, 5))
    assert_same(values, uninterrupted, atol=0)  # same size: bit for bit


@pytest.mark.parametrize("survivors", [False, True], ids=["restart", "survivors-stay"])
def test_resized_two_three_one_through_the_data_loader(uninterrupted, log_dir, recorder,
                                                       survivors):
    values = train(log_dir, recorder, every=5, resizes=((5, 3), (20, 1)),
                   min_nproc=1, max_nproc=3, survivors=survivors)
    assert_stayed(recorder, [(0, 1), (0,)] if survivors else [(), ()])
    assert [(m.old_nproc, m.new_nproc) for m in recorder.of(MembershipChanged)] == [(2, 3),
                                                                                   (3, 1)]
    assert done_steps(recorder) == list(range(1, STEPS + 1))  # every step once
    # A graceful resize waits for the next commit: only multiples of 5 were committed.
    assert committed_steps(recorder) == list(range(5, STEPS + 1, 5))
    # Other world sizes sum the same global batch in another order: float rounding.
    assert_same(values, uninterrupted, atol=1e-5)


SWITCH = textwrap.dedent("""
    import time, torch, torch.distributed as dist
    from torch.utils.data import DistributedSampler, TensorDataset
    import elastic_magic

    dataset = TensorDataset(torch.arange(48))
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * dist.get_world_size())

    def scale_lr(old, new):  # fixed per-rank batch: the global batch changed, so the LR does
        for group in opt.param_groups:
            group["lr"] *= new / old
        print(f"RESIZED {old} -> {new}", flush=True)

    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = elastic_magic.DataLoader(dataset, batch_size=4, sampler=sampler)  # the switch
    state = elastic_magic.State(optimizer=opt, loader=loader, step=0, epoch=0,
                                on_resize=scale_lr)
    rank, world = dist.get_rank(), dist.get_world_size()
    for epoch in range(state.epoch, 2):
        sampler.set_epoch(epoch)
        for (indices,) in loader:
            state.step += 1
            print(f"SEEN {epoch} {world} {opt.param_groups[0]['lr']:.2f} "
                  f"{' '.join(map(str, indices.tolist()))}", flush=True)
            time.sleep(0.05)
            state.commit()
        state.epoch = epoch + 1
""")


def test_distributed_sampler_switch_keeps_every_sample_once_per_epoch(log_dir, recorder):
    spec = JobSpec.create(2, log_dir=log_dir, min_nproc=1, max_nproc=2)
    job = Job(spec, build_payload(SWITCH, spec)).start()

    def drive():
        job.wait_for_commit(3, timeout=120)
        job.scale(1)

    threading.Thread(target=drive, daemon=True).start()
    result = job.wait(recorder)
    assert result.ok and result.resizes == 1, result
    seen = [line.split() for rank in (0, 1) for line in recorder.lines(rank)
            if line.startswith("SEEN")]
    for epoch in ("0", "1"):
        indices = sorted(int(i) for row in seen if row[1] == epoch for i in row[4:])
        assert indices == list(range(48)), f"epoch {epoch}"
    assert {(row[2], row[3]) for row in seen} == {("2", "0.20"), ("1", "0.10")}
    assert "RESIZED 2 -> 1" in recorder.lines(0)
    # The same order as torch's DistributedSampler (seed + epoch), 4 per rank per step.
    order = torch.randperm(48, generator=torch.Generator().manual_seed(3)).tolist()
    first = [[int(i) for i in row[4:]] for row in seen if row[1] == "0" and row[2] == "2"]
    assert first[0] in (order[0:4], order[4:8])


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def test_every_stateful_object_is_restored_in_place(tmp_path):
    def build():
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        return (net, AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.5)), scaler,
                Counter(), torch.Generator().manual_seed(5))

    net, ema, scaler, counter, generator = build()
    state = em.State(model=net, ema=ema, scaler=scaler, counter=counter, noise=generator,
                     step=0)
    net.weight.data.add_(1.0)
    ema.update_parameters(net)
    scaler.scale(torch.ones(()))
    scaler.update(8.0)
    counter.count = 7
    torch.rand(3, generator=generator)
    state.step += 1
    state.commit()  # outside a job: commits nowhere, still counts
    blob = state.snapshot()
    expected = (torch.rand(3), random.random(), numpy.random.rand(),
                torch.rand(2, generator=generator))

    net2, ema2, scaler2, counter2, generator2 = build()
    resized = []
    other = em.State(model=net2, ema=ema2, scaler=scaler2, counter=counter2, noise=generator2,
                     step=0, on_resize=lambda old, new: resized.append((old, new)))
    other.load(blob)
    assert other.step == 1 and other.counter is counter2 and counter2.count == 7
    assert other.scaler is scaler2 and scaler2.get_scale() == 8.0
    torch.testing.assert_close(net2.weight, net.weight, rtol=0, atol=0)
    for a, b in zip(ema2.parameters(), ema.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ema2.n_averaged.item() == ema.n_averaged.item() == 1
    assert other.noise is generator2
    got = (torch.rand(3), random.random(), numpy.random.rand(), torch.rand(2, generator=generator2))
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert got[1:3] == expected[1:3]
    torch.testing.assert_close(got[3], expected[3], rtol=0, atol=0)
    assert resized == []  # same world size: the hook does not run

    with pytest.raises(TypeError, match=r"cannot restore batches=generator.*state_dict"):
        em.State(batches=(i for i in range(3)))
    with (tmp_path / "f").open("w") as file, pytest.raises(TypeError,
                                                          match="cannot restore log="):
        em.State(log=file)
    with pytest.raises(TypeError, match="cannot restore it=list_iterator"):
        state.it = iter([1, 2])
    # Its position is per rank: resumed at another world size it skips samples.
    from torchdata.stateful_dataloader import StatefulDataLoader

    with pytest.raises(TypeError, match=r"world size.*Use elastic_magic\.DataLoader"):
        em.State(loader=StatefulDataLoader(TensorDataset(torch.arange(4))))


def test_data_loader_records_what_the_loop_consumed_and_refuses_what_it_cannot():
    dataset = TensorDataset(torch.arange(24))
    sampler = em.ElasticSampler(24, global_batch_size=6, seed=0)
    loader = em.DataLoader(dataset, batch_sampler=sampler, num_workers=2, prefetch_factor=2)
    batches = iter(loader)
    first = [next(batches)[0].tolist() for _ in range(2)]  # 4 more are prefetched
    assert sampler.state_dict() == {"epoch": 0, "offset": 12}
    blob = em.State(loader=loader).snapshot()
    rest = [b[0].tolist() for b in batches]
    with pytest.raises(RuntimeError, match=r"call sampler\.set_epoch"):
        next(iter(loader))

    again = em.ElasticSampler(24, global_batch_size=6, seed=0)
    em.State(loader=again).load(blob)  # restored by name: any stateful object will do
    assert list(again) == rest  # the next unseen batches, none lost
    assert sorted(i for batch in first + rest for i in batch) == list(range(24))

    with pytest.raises(TypeError, match=r"use elastic_magic\.DataLoader"):
        list(torch.utils.data.DataLoader(dataset, batch_sampler=em.ElasticSampler(24, 6)))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="map-style dataset"):
        em.DataLoader(Stream(), batch_sampler=sampler)
    with pytest.raises(TypeError, match=r"batch_sampler=elastic_magic\.ElasticSampler"):
        em.DataLoader(dataset, batch_size=4)
    with pytest.raises(ValueError, match="give its sizes to the ElasticSampler"):
        em.DataLoader(dataset, batch_size=4, batch_sampler=sampler)
    with pytest.raises(ValueError, match="takes shuffle from its sampler"):
        em.DataLoader(dataset, batch_sampler=sampler, shuffle=True)
    with pytest.raises(ValueError, match="either global_batch_size"):
        em.ElasticSampler(24, 6, batch_size=3)


@pytest.mark.unit
def test_a_global_batch_size_alone_makes_a_shuffled_elastic_loader():
    """As the docs' examples write it: DataLoader(data, global_batch_size=...)."""
    dataset = TensorDataset(torch.arange(20))
    loader = em.DataLoader(dataset, global_batch_size=6)
    sampler = loader.elastic_sampler
    assert (sampler.global_batch_size, sampler.shuffle, sampler.drop_last) == (6, True, True)
    batches = [b[0].tolist() for b in loader]
    assert [len(b) for b in batches] == [6, 6, 6]  # full global batches only
    # 18 different samples, shuffled
    assert len({i for batch in batches for i in batch}) == 18
    assert batches != [list(range(i, i + 6)) for i in (0, 6, 12)]
    plain = em.DataLoader(dataset, global_batch_size=6, shuffle=False, drop_last=False)
    assert [b[0].tolist() for b in plain][:3] == [list(range(i, i + 6)) for i in (0, 6, 12)]
    assert plain.elastic_sampler.drop_last is False
    with pytest.raises(TypeError, match="needs global_batch_size="):
        em.DataLoader(dataset)


def test_snapshot_layout_of_earlier_versions_still_loads():
    model = torch.nn.Linear(2, 1)
    old = io.BytesIO()
    torch.save({"values": {"step": 3}, "commits": 3, "model": model.state_dict(),
                "sampler": {"epoch": 1, "position": 2},
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}}, old)
    sampler = em.ElasticSampler(24, 6)
    state = em.State(model=torch.nn.Linear(2, 1), sampler=sampler, step=0)
    state.load(old.getvalue())
    assert state.step == 3 and sampler.state_dict() == {"epoch": 1, "offset": 12}
    torch.testing.assert_close(state.model.weight, model.weight, rtol=0, atol=0)


def test_commit_intervals_and_the_distributed_sampler_for_a_fixed_global_batch():
    state = em.State(step=0)
    assert [state.commit(every=3) for _ in range(6)] == [False, False, True] * 2
    assert state.commit(every=100, seconds=0.0) is True  # whichever comes first
    assert state.commit(every=100, seconds=3600.0) is False
    with pytest.raises(ValueError, match="every=0"):
        state.commit(every=0)

    dataset = TensorDataset(torch.arange(20))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, seed=3)
    loader = em.DataLoader(dataset, global_batch_size=6, sampler=sampler, drop_last=False)
    sampler.set_epoch(1)
    batches = [b[0].tolist() for b in loader]
    order = torch.randperm(20, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    assert batches == [order[0:6], order[6:12], order[12:18], order[18:20] + order[0:4]]
