"""Lightning and HF's Trainer on CUDA, made elastic by their one line (``ElasticDDP``,
``ElasticCallback``): one rank per GPU (two at most), fp16 mixed precision with a grad
scaler whose scale grows, dropout on the CUDA generator. The last rank SIGKILLs itself
between two commits; the restarted fit goes on from the last commit and ends at the
uninterrupted run's weights and scale, bit for bit, having trained again only the steps
since that commit. On a machine with one GPU the job is one rank, the one that dies: the
whole restore (CUDA tensors, the scaler, the CUDA random state) runs with nothing to copy
from a survivor. CI has no GPU: run on a GPU machine with ``python -m pytest -m gpu -n 1``
(one test at a time); skipped without CUDA."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch
from conftest import done_steps

import elastic_magic as em
from elastic_magic.wire.events import Committed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# At most two ranks: a restarted DDP's first step sums its gradient buckets in another
# layout than the uninterrupted run's, which only two ranks' sums (a + b) do not feel.
RANKS = min(2, torch.cuda.device_count())

# 20 steps over 96 samples, 6 per rank a step; the last rank dies once, during the step
# after KILL_AT (the file KILLED says it did).
LIGHTNING = textwrap.dedent("""
    import os, random, signal, torch, torch.distributed as dist
    import pytorch_lightning as pl
    from pytorch_lightning.plugins import MixedPrecision
    from elastic_magic.integrations.lightning import ElasticDDP

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2),
                                           torch.nn.Tanh(), torch.nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            if self.global_step == KILL_AT and not os.path.exists(KILLED):
                dist.barrier()  # the other ranks have said their step is done
                if dist.get_rank() == dist.get_world_size() - 1:
                    open(KILLED, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
            return [opt], [{"scheduler": sched, "interval": "step"}]

    class Done(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_rank == 0:
                print(f"DONE step {trainer.global_step} on {pl_module.device.type}",
                      flush=True)

    torch.manual_seed(0); random.seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    model = Tiny()
    # fp16 with a scale that doubles every 3 steps: a scaler not restored ends lower
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10, growth_interval=3)
    trainer = pl.Trainer(
        strategy=ElasticDDP(every=5), accelerator="gpu",
        plugins=[MixedPrecision("16-mixed", "cuda", scaler)], max_steps=20,
        callbacks=[Done()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=6, shuffle=True))
    # (fit's end moves the model back to the CPU: the steps say where they ran)
    ([p.detach().cpu() for p in model.parameters()], trainer.precision_plugin.scaler.get_scale(),
     torch.distributed.get_backend())
""")


def _lightning(log_dir, recorder, kill_at: int) -> em.JobResult:
    pytest.importorskip("pytorch_lightning")
    killed = log_dir / f"killed-{kill_at}"
    result = em.launch(LIGHTNING, nproc=RANKS, max_restarts=1, log_dir=log_dir,
                       namespace={"KILL_AT": kill_at, "KILLED": str(killed)}, render=recorder)
    assert result.ok, result
    return result


def test_lightning_fit_on_cuda_killed_between_commits_resumes_bit_for_bit(log_dir, recorder):
    from conftest import Recorder

    clean = _lightning(log_dir, Recorder(), kill_at=-1)
    killed = _lightning(log_dir, recorder, kill_at=13)
    assert clean.restarts == 0 and killed.restarts == 1
    # Steps 1-13 ran, the last rank died in step 14: fit went on from the commit of step
    # 10, so only 11-13 ran twice.
    assert done_steps(recorder) == list(range(1, 14)) + list(range(11, 21))
    assert {line.split()[-1] for line in recorder.lines(0) if line.startswith("DONE")} == {
        "cuda"}
    assert [e.step for e in recorder.of(Committed)] == [5, 10, 15, 20]
    (params, scale, backend), (killed_params, killed_scale, _) = (clean.values[0],
                                                                  killed.values[0])
    assert backend == "nccl"
    assert killed_scale == scale > 2.0 ** 10  # the scale grew, and was restored
    for a, b in zip(params, killed_params, strict=True):
        assert torch.equal(a, b)


# HF's Trainer, trained twice in each process: uninterrupted without the callback (the
# reference), then with it, where the last rank dies before step KILL_AT + 1 once.
TRAINER = textwrap.dedent("""
    import os, random, signal, numpy, torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from elastic_magic.integrations.transformers import ElasticCallback

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    class Tiny(torch.nn.Module):  # random draws from CUDA (dropout), python and numpy
        def __init__(self):
            super().__init__()
            self.hidden, self.out = torch.nn.Linear(4, 32), torch.nn.Linear(32, 1)
            self.drop = torch.nn.Dropout(0.2)

        def forward(self, x, labels):
            weight = 1 + (random.random() + numpy.random.rand()) / 10
            y = self.out(self.drop(torch.tanh(self.hidden(x))))
            return {"loss": torch.nn.functional.mse_loss(y.float(), labels) * weight}

    g = torch.Generator().manual_seed(1)
    xs = torch.randn(96, 4, generator=g)
    data = [{"x": x, "labels": x.sum(0, keepdim=True).sin()} for x in xs]

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if attempt == 0 and state.global_step == KILL_AT:
                torch.distributed.barrier()  # the other ranks have said their step is done
                if rank == world - 1:
                    os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, args, state, control, **kwargs):
            if rank == 0:
                print(f"DONE step {state.global_step}", flush=True)

    def trainer(callbacks):
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=OUT, fp16=True, report_to=[], save_strategy="no",
            per_device_train_batch_size=6, max_steps=20, learning_rate=0.01,
            warmup_steps=3, logging_steps=4, disable_tqdm=True, seed=0,
            ddp_find_unused_parameters=False)
        made = Trainer(Tiny(), args, train_dataset=data, callbacks=callbacks)
        # a scale that doubles every 3 steps (train() prepares the optimizer with it): a
        # scaler not restored ends lower
        made.accelerator.scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10,
                                                       growth_interval=3)
        return made

    def outcome(trainer):
        model = trainer.model
        return ([p.detach().cpu().tolist() for p in model.parameters()],
                [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e],
                trainer.accelerator.scaler.get_scale(), next(model.parameters()).device.type)

    plain = trainer([])
    plain.train()
    if rank == 0:
        print("REFERENCE", outcome(plain), flush=True)
    elastic = trainer([ElasticCallback(every=4), Steps()])
    elastic.train()
    outcome(elastic)
""")


def test_hf_trainer_on_cuda_killed_between_commits_resumes_bit_for_bit(tmp_path, log_dir,
                                                                       recorder):
    pytest.importorskip("transformers")
    result = em.launch(TRAINER, nproc=RANKS, max_restarts=1, log_dir=log_dir,
                       namespace={"KILL_AT": 10, "OUT": str(tmp_path)}, render=recorder)
    assert result.ok and result.restarts == 1, result
    # The last rank died before step 11: the restarted train() went on from the commit of
    # step 8, so only 9 and 10 ran twice (the reference, run again first, prints none).
    assert done_steps(recorder) == [*range(1, 11), *range(9, 21)]
    assert [e.step for e in recorder.of(Committed)] == [4, 8, 12, 16]
    got = result.values[0]
    line = [x for x in recorder.lines(0) if x.startswith("REFERENCE ")][-1]
    want = ast.literal_eval(line.removeprefix("REFERENCE "))
    assert got[3] == "cuda" and got[2] > 2.0 ** 10  # the scale grew
    assert got == want  # weights, logged losses and the scaler's scale, exactly
