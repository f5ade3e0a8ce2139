"""The GPU path: one worker per GPU, nccl, torch.cuda.set_device(LOCAL_RANK), elastic state
on CUDA, and GPU memory released when a job is stopped. CI has no GPU, so these run on a
GPU machine, one test at a time (`python -m pytest -m gpu -n 1`: one measures the GPU's
free memory); without CUDA they are reported as skipped."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

import elastic_magic as em
from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec, SpecError
from elastic_magic.wire.payload import build_payload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_one_nccl_worker_per_gpu_after_the_kernel_touched_cuda(ip, log_dir):
    # Fork-based launchers break once the parent has initialised CUDA; fresh
    # interpreters do not care.
    ip.run_cell("import torch\nkernel_tensor = torch.ones(4, device='cuda')\n")
    cell = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        t = torch.full((4,), float(dist.get_rank() + 1), device="cuda")
        dist.all_reduce(t)
        {"backend": dist.get_backend(), "device": torch.cuda.current_device(),
         "local_rank": int(os.environ["LOCAL_RANK"]), "tensor_device": t.device.type,
         "sum": t[0].item()}
    """)
    result = ip.run_cell_magic("elastic", f"--nproc gpu --text --log-dir {log_dir}", cell)
    gpus = torch.cuda.device_count()
    assert sorted(result.values) == list(range(gpus))
    for value in result.values.values():
        assert value["backend"] == "nccl" and value["tensor_device"] == "cuda"
        assert value["device"] == value["local_rank"]
        assert value["sum"] == gpus * (gpus + 1) / 2


def test_more_nccl_workers_than_gpus_is_refused_before_start(log_dir):
    with pytest.raises(SpecError, match="one worker per GPU"):
        JobSpec.create(torch.cuda.device_count() + 1, backend="nccl", log_dir=log_dir)


# Dropout draws from the CUDA generator: bit-equal resumption needs its state restored.
TRAIN_ON_GPU = textwrap.dedent("""
    import os, signal, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import elastic_magic

    torch.manual_seed(0)
    local = int(os.environ["LOCAL_RANK"])
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.2),
                              torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    model = DDP(net, device_ids=[local])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(256, 32, generator=g).cuda()
    target = data.sum(1, keepdim=True).sin()
    sampler = elastic_magic.ElasticSampler(len(data), 16, seed=0)
    state = elastic_magic.State(model=model, optimizer=opt, sampler=sampler, step=0)
    for idx in sampler:
        if state.step == KILL_AT and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(data[idx]), target[idx]).backward()
        opt.step()
        state.step += 1
        state.commit()
    [p.detach().cpu() for p in net.parameters()]
""")


def _train(log_dir, kill_at: int):
    return em.launch(TRAIN_ON_GPU, namespace={"KILL_AT": kill_at}, nproc="gpu",
                     max_restarts=1, log_dir=log_dir, render=lambda events: None)


def test_gpu_training_killed_mid_way_resumes_bit_for_bit(log_dir):
    clean = _train(log_dir, kill_at=-1)
    killed = _train(log_dir, kill_at=5)
    assert clean.restarts == 0 and killed.restarts == 1
    for a, b in zip(clean.values[0], killed.values[0], strict=True):
        assert torch.equal(a, b)


def test_stopping_a_job_releases_its_gpu_memory(log_dir):
    torch.cuda.init()
    free_before, _ = torch.cuda.mem_get_info()
    spec = JobSpec.create("gpu", log_dir=log_dir)
    payload = build_payload(textwrap.dedent("""
        import time, torch
        block = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        print("holding", flush=True)
        time.sleep(600)
    """), spec, namespace={})
    job = Job(spec, payload).start()
    deadline = time.monotonic() + 120
    while torch.cuda.mem_get_info()[0] > free_before - 2 * 1024**3:
        assert time.monotonic() < deadline and not job.done, "the worker never took its GPU memory"
        time.sleep(0.2)
    job.stop()
    result = job.wait()
    assert result.state is em.JobState.STOPPED
    deadline = time.monotonic() + 30
    while torch.cuda.mem_get_info()[0] < free_before - 256 * 1024**2:
        assert time.monotonic() < deadline, "GPU memory still held after the job stopped"
        time.sleep(0.2)
