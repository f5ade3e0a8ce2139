"""A sharded State on GPUs: an FSDP2 model on CUDA over NCCL (one rank per GPU), Adam,
commits every 5 steps (each copied to pinned host memory, then sent behind the training).
A rank killed between two commits replays to the uninterrupted run's parameters and Adam
moments bit for bit. CI has no GPU: run on a GPU machine; skipped without CUDA."""

from __future__ import annotations

import textwrap

import pytest
import torch

from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.payload import build_payload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TRAIN = textwrap.dedent("""
    import os, signal, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import elastic_magic

    torch.manual_seed(0)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.1),
                                torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(240, 8, generator=g).to(device)
    target = torch.sin(data.sum(1, keepdim=True))
    sampler = elastic_magic.ElasticSampler(len(data), global_batch_size=12, seed=0)
    state = elastic_magic.State(model=model, optimizer=opt, sampler=sampler, step=0, epoch=0)
    for epoch in range(state.epoch, 2):
        sampler.set_epoch(epoch)
        for indices in sampler:
            if (state.step == KILL_AT and dist.get_rank() == 0
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                os.kill(os.getpid(), signal.SIGKILL)
            loss = torch.nn.functional.mse_loss(model(data[indices]), target[indices])
            loss.backward()
            opt.step()
            opt.zero_grad()
            state.step += 1
            state.commit(every=5)
        state.epoch = epoch + 1
    ([p.full_tensor().cpu() for p in model.parameters()],
     [opt.state[p]["exp_avg_sq"].full_tensor().cpu() for p in model.parameters()],
     dist.get_backend())
""")


def _train(log_dir, kill_at, **spec_args):
    spec = JobSpec.create(torch.cuda.device_count(), backend="nccl", log_dir=log_dir,
                          **spec_args)
    job = Job(spec, build_payload(TRAIN, spec, namespace={"KILL_AT": kill_at})).start()
    result = job.wait(lambda events: None)
    assert result.ok, result
    return result


def test_fsdp2_on_cuda_killed_between_commits_replays_bit_for_bit(log_dir):
    clean = _train(log_dir, kill_at=-1)
    killed = _train(log_dir, kill_at=12, max_restarts=1)
    assert killed.restarts == 1
    params, moments, backend = clean.values[0]
    killed_params, killed_moments, killed_backend = killed.values[0]
    assert backend == killed_backend == "nccl"
    for a, b in zip(params + moments, killed_params + killed_moments, strict=True):
        assert torch.equal(a, b)
