"""PyTorch Lightning made elastic with one line (``Trainer(strategy=ElasticDDP(every=5))``,
``elastic_magic.integrations.lightning``): a rank SIGKILLed between commits resumes
``trainer.fit`` from the last commit and ends at the uninterrupted run's weights, bit for
bit, having trained again only the steps since that commit; a resize 2 -> 3 at a commit
ends within float rounding of it; the docs' example runs as written."""

from __future__ import annotations

import re
import textwrap

import pytest
import readme
import torch
from conftest import assert_stayed, done_steps, run_resized
from netns import network as network  # the fixture
from test_networks import run_head

import elastic_magic as em
from elastic_magic.agent.handles.job import Job
from elastic_magic.agent.node.pool import warm_pool
from elastic_magic.spec import JobSpec
from elastic_magic.wire.events import Committed, MembershipChanged
from elastic_magic.wire.payload import build_payload

# A tiny Lightning training: 20 optimizer steps of a global batch of 12 (6 per rank at 2,
# 4 at 3) over 96 shuffled samples (8 steps an epoch: the kill and the resize land mid-
# epoch, and the run crosses two epoch ends), SGD with momentum, a step-wise LR schedule,
# and a loss weight drawn each step from torch's and python's RNGs (the same on every rank
# and at every world size: a wrong RNG restore changes the weights). Rank 1 SIGKILLs
# itself once, during step KILL_AT + 1 (the file KILLED says it did: on several machines
# each machine's agent counts its own restarts, as torchrun's do, so the restart count is
# not the same on every rank).
TRAIN = textwrap.dedent("""
    import os, random, signal, time, torch, torch.distributed as dist
    import pytorch_lightning as pl
    from elastic_magic.integrations.lightning import ElasticDDP

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            if self.global_step == KILL_AT and not os.path.exists(KILLED):
                dist.barrier()  # rank 0 has said its step is done before rank 1 dies
                if dist.get_rank() == 1:
                    open(KILLED, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch
            weight = 1 + (torch.rand(()).item() + random.random()) / 10
            return torch.nn.functional.mse_loss(self.net(x), y) * weight

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
            return [opt], [{"scheduler": sched, "interval": "step"}]

    class Done(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_rank == 0:
                print(f"DONE step {trainer.global_step} world {trainer.world_size}", flush=True)
            time.sleep(PAUSE)

    torch.manual_seed(0); random.seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    model = Tiny()
    trainer = pl.Trainer(
        strategy=ElasticDDP(every=5, process_group_backend="gloo"), accelerator="cpu",
        max_steps=20, callbacks=[Done()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=6, shuffle=True))
    [p.detach().clone() for p in model.parameters()]
""")
STEPS = 20


def train(log_dir, recorder, *, kill_at=-1, resizes=(), **spec_args):
    spec = JobSpec.create(2, log_dir=log_dir, **spec_args)
    namespace = {"KILL_AT": kill_at, "PAUSE": 0.05 if resizes else 0.0,
                 "KILLED": str(log_dir / "killed")}
    job = Job(spec, build_payload(TRAIN, spec, namespace=namespace)).start()
    return run_resized(job, recorder, resizes).values[0]


def committed_steps(recorder) -> list[int]:
    return [e.step for e in recorder.of(Committed)]


def assert_close(got, want, atol):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from conftest import Recorder

    recorder = Recorder()
    values = train(tmp_path_factory.mktemp("logs"), recorder)
    # The pool learns what the cell imported (Lightning's own modules it leaves out: they
    # read RANK when imported); the runs below fork from that zygote, not beside its build.
    warm_pool().wait_rebuilt(180)
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert committed_steps(recorder) == list(range(5, STEPS + 1, 5))
    return values


def test_rank_killed_between_commits_resumes_fit_at_the_last_commit(uninterrupted, log_dir,
                                                                     recorder):
    values = train(log_dir, recorder, kill_at=13, max_restarts=1)
    # Steps 1-13 ran, rank 1 died in step 14; fit resumed from the commit of step 10:
    # only steps 11-13 ran twice, none was skipped.
    assert done_steps(recorder) == list(range(1, 14)) + list(range(11, STEPS + 1))
    assert committed_steps(recorder) == list(range(5, STEPS + 1, 5))
    assert_close(values, uninterrupted, atol=0)  # same world size: bit for bit


def test_resized_two_to_three_goes_on_from_the_commit(uninterrupted, log_dir, recorder):
    # With survivors: ranks 0 and 1 run the cell again in their processes, rank 2 is new.
    values = train(log_dir, recorder, resizes=((5, 3),), min_nproc=1, max_nproc=3,
                   survivors=True)
    assert_stayed(recorder, [(0, 1)])
    assert [(m.old_nproc, m.new_nproc) for m in recorder.of(MembershipChanged)] == [(2, 3)]
    done = [line.split() for line in recorder.lines(0) if line.startswith("DONE")]
    assert [int(row[2]) for row in done] == list(range(1, STEPS + 1))  # every step once
    # Graceful: the ranks left at a commit (the first that came after the request), and the
    # group of 3 went on from the step after it.
    first = next(int(row[2]) for row in done if row[4] == "3")
    assert first - 1 in committed_steps(recorder) and first < STEPS
    assert {row[4] for row in done if int(row[2]) >= first} == {"3"}
    # 3 ranks sum the same global batch of 12 in another order: float rounding.
    assert_close(values, uninterrupted, atol=1e-5)


@pytest.mark.cluster
@pytest.mark.parametrize("network", [1], indirect=True)
def test_a_rank_killed_on_another_machine_resumes_fit_there_at_the_last_commit(
        uninterrupted, network, log_dir, recorder):
    """Rank 1 runs on a machine of the test network (``elastic-magic join``): Lightning's
    ``num_nodes`` and ``devices`` come from the job (2 and 1), and its death resumes fit
    from the commit of step 10, as on one machine."""
    spec = JobSpec.create(1, nnodes=2, rdzv_endpoint=network.head_address, log_dir=log_dir,
                          max_restarts=1, timeout=60)
    joined = []

    def on_open(job, endpoint):
        joined.append(network.join(1, endpoint, job.token))

    result = run_head(spec, TRAIN + "\n(trainer.num_nodes, trainer.num_devices, "
                      "[p.detach().clone() for p in model.parameters()])",
                      recorder, namespace={"KILL_AT": 13, "PAUSE": 0.0,
                                           "KILLED": str(log_dir / "killed")},
                      on_open=on_open)
    outputs = [network.output(proc) for proc in joined]
    assert result.ok, (result, outputs)
    assert [proc.wait(timeout=60) for proc in joined] == [0], outputs
    assert result.restarts == 1
    assert done_steps(recorder) == list(range(1, 14)) + list(range(11, STEPS + 1))
    assert committed_steps(recorder) == list(range(5, STEPS + 1, 5))
    nodes, devices, values = result.values[0]
    assert (nodes, devices) == (2, 1)
    assert_close(values, uninterrupted, atol=0)  # the same world size: bit for bit


def test_the_readme_lightning_example_runs_as_written(log_dir, recorder):
    line, cell = readme.magic(readme.cells("%%elastic --nproc 2 --max-restarts 3")[0])
    assert line == "--nproc 2 --max-restarts 3"
    result = em.launch(cell, nproc=2, max_restarts=3, log_dir=log_dir, render=recorder)
    assert result.values == {0: 60, 1: 60}
    assert committed_steps(recorder) == list(range(5, 61, 5))
    assert not re.search(r"Traceback|Error", "\n".join(recorder.lines(0, "stderr")))


@pytest.mark.unit
def test_the_private_lightning_names_it_relies_on_are_there(tmp_path):
    """Lightning's checkpoint dict is made and restored through two private names; this
    Lightning has them, a given ``_loaded_checkpoint`` survives a ``fit`` without a
    ``ckpt_path`` (what the restore relies on), and a Lightning without them is refused."""
    import pytorch_lightning as pl

    from elastic_magic.integrations.lightning import _LightningPrivate

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                         default_root_dir=str(tmp_path))
    connector = _LightningPrivate.connector(trainer)
    _LightningPrivate.preload(trainer, {"global_step": 7})
    connector.resume_start(None)  # as Trainer._run does when fit is given no ckpt_path
    assert connector._loaded_checkpoint == {"global_step": 7}
    with pytest.raises(RuntimeError, match="report it"):
        _LightningPrivate.connector(object())


@pytest.mark.unit
def test_devices_and_nodes_are_the_jobs(monkeypatch):
    import pytorch_lightning as pl
    from lightning_fabric.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    from elastic_magic.integrations.lightning import ElasticDDP

    for function in (rank_zero_only, utils_rank_zero_only):  # the Trainer sets them: rank 2
        monkeypatch.setattr(function, "rank", getattr(function, "rank", 0), raising=False)
    # A process where sys.ps1 is set (IPython ran in it before Lightning was imported, as in
    # a full run of this suite): a job's ranks are launched already, nothing refuses them.
    monkeypatch.setattr("pytorch_lightning.trainer.connectors.accelerator_connector."
                        "_IS_INTERACTIVE", True)
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                        "RANK": "2", "LOCAL_RANK": "2", "GROUP_WORLD_SIZE": "1",
                        "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    trainer = pl.Trainer(strategy=ElasticDDP(every=5), accelerator="cpu", devices=2,
                         logger=False)
    assert (trainer.num_devices, trainer.num_nodes, trainer.world_size) == (3, 1, 3)
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 2}
    with pytest.raises(ValueError, match="every=0"):
        ElasticDDP(every=0)
