"""HF transformers' Trainer made elastic by one callback (``ElasticCallback``): a rank
SIGKILLed between commits makes the restarted ``trainer.train()`` go on from the last
commit, redo only the steps since, and end at the uninterrupted run's weights and log
history bit for bit; a resize 2 -> 3 (survivors staying) ends within float rounding of
it; the docs' example runs as written. Real processes, gloo on CPU."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest
import readme
import torch
from conftest import assert_stayed, done_steps, run_resized

from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.events import Committed, MembershipChanged, Restarting
from elastic_magic.wire.payload import build_payload

pytest.importorskip("transformers")

# A tiny regression with AdamW, a linear schedule with warm-up (the scheduler's state
# matters), 96 samples in global batches of 12 (8 steps an epoch: 20 steps cross two
# epoch boundaries), logs every 4 steps. The cell trains twice in each process: first
# without the callback, uninterrupted (the reference: same world size, same arithmetic),
# then with it, where rank 1 dies before the step after each (attempt, global step) of
# KILLS. With NOISE the forward draws from torch (dropout), python and numpy.
CELL = textwrap.dedent("""
    import os, random, signal, time, numpy, torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from elastic_magic.integrations.transformers import ElasticCallback

    GLOBAL_BATCH, STEPS = 12, 20
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    class Tiny(torch.nn.Module):  # with NOISE, random draws from torch, python and numpy
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.drop = torch.nn.Dropout(0.2 if NOISE else 0.0)

        def forward(self, x, labels):
            weight = 1 + (random.random() + numpy.random.rand()) / 10 if NOISE else 1.0
            loss = torch.nn.functional.mse_loss(self.layer(self.drop(x)), labels)
            return {"loss": loss * weight}

    g = torch.Generator().manual_seed(1)
    xs = torch.randn(96, 4, generator=g)
    data = [{"x": x, "labels": x.sum(0, keepdim=True).sin()} for x in xs]

    class Steps(TrainerCallback):  # what rank 0 trained, and rank 1's death
        def on_step_begin(self, args, state, control, **kwargs):
            if (attempt, state.global_step) in KILLS:
                torch.distributed.barrier()  # rank 0 has said its step is done first
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, args, state, control, **kwargs):
            if rank == 0:
                print(f"DONE step {state.global_step} world {world}", flush=True)
            time.sleep(PAUSE)

    def trainer(callbacks):
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=OUT, use_cpu=True, ddp_backend="gloo", report_to=[],
            save_strategy="no", per_device_train_batch_size=GLOBAL_BATCH // world,
            max_steps=STEPS, learning_rate=0.05, warmup_steps=3, logging_steps=4,
            disable_tqdm=True, seed=0, ddp_find_unused_parameters=False)
        return Trainer(Tiny(), args, train_dataset=data, callbacks=callbacks)

    def weights(model):
        return [p.detach().clone() for p in model.parameters()]

    def logged(trainer):  # the log history: each log's step, epoch and loss
        return [(e["step"], e["epoch"], e["loss"]) for e in trainer.state.log_history
                if "loss" in e]

    if world == 2:  # the reference, at the first world size
        plain = trainer([])
        plain.train()
        if rank == 0:
            print("REFERENCE", ([p.tolist() for p in weights(plain.model)], logged(plain)),
                  flush=True)
    elastic = trainer([ElasticCallback(every=EVERY), Steps()])
    elastic.train()
    (weights(elastic.model), logged(elastic))
""")


def _train(log_dir: Path, tmp_path: Path, recorder, *, every: int, kills=(), resizes=(),
           **spec_args):
    # The warm pool imports transformers' Trainer once (4 s here), not every rank.
    spec = JobSpec.create(2, log_dir=log_dir, preload="transformers.trainer", **spec_args)
    namespace = {"KILLS": kills, "EVERY": every, "OUT": str(tmp_path), "NOISE": not resizes,
                 "PAUSE": 0.05 if resizes else 0.0}
    job = Job(spec, build_payload(CELL, spec, namespace=namespace)).start()
    return run_resized(job, recorder, resizes)


def _reference(recorder) -> tuple[list[torch.Tensor], list[tuple[int, float, float]]]:
    """The weights and log history of the uninterrupted run at world size 2."""
    lines = [line for line in recorder.lines(0) if line.startswith("REFERENCE ")]
    weights, logged = ast.literal_eval(lines[-1].removeprefix("REFERENCE "))
    return [torch.tensor(p) for p in weights], logged


def test_rank_killed_between_commits_resumes_at_the_commit_and_ends_bit_for_bit(
        tmp_path, log_dir, recorder):
    # Commits every 4 steps. Killed after step 10: resumed at the commit of step 8, the end
    # of the first epoch; killed again after step 14: resumed at step 12, in the middle
    # of the second (HF skips its first 4 batches).
    result = _train(log_dir, tmp_path, recorder, every=4, kills=((0, 10), (1, 14)),
                    max_restarts=2)
    assert result.restarts == 2
    assert not any(restart.no_state for restart in recorder.of(Restarting))
    # Only the steps since the last commit ran again: 9 and 10, then 13 and 14.
    assert done_steps(recorder) == [*range(1, 11), *range(9, 15), *range(13, 21)]
    assert [e.step for e in recorder.of(Committed)] == [4, 8, 12, 16]
    got, logged = result.values[0]
    want, want_logged = _reference(recorder)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(map(torch.equal, result.values[1][0], got))
    # The TrainerState came back (the log history before the commit, the epoch after it)
    # and the loss added up since the log of step 8: the log of step 12 averages steps
    # 9-12, as uninterrupted.
    assert [(step, epoch) for step, epoch, _ in logged] == [
        (4, 0.5), (8, 1.0), (12, 1.5), (16, 2.0), (20, 2.5)]
    assert logged == want_logged


def test_resize_two_to_three_keeps_the_global_batch_and_ends_within_rounding(
        tmp_path, log_dir, recorder):
    # --survivors: ranks 0 and 1 stay in their processes and run the cell again at world
    # size 3 (HF's Trainer cannot go on inside train(): its arguments, accelerator and
    # DDP model hold the old group and world size).
    result = _train(log_dir, tmp_path, recorder, every=5, resizes=((5, 3),), min_nproc=1,
                    max_nproc=3, survivors=True)
    assert [(m.old_nproc, m.new_nproc) for m in recorder.of(MembershipChanged)] == [(2, 3)]
    assert_stayed(recorder, [(0, 1)])
    assert result.world_size == 3
    # Every step once: the ranks left at the commit after the request (the start of step
    # 11, or 16 on a slow day), and world 3 went on from there.
    assert done_steps(recorder) == list(range(1, 21))
    resumed = [int(m.group(1)) for line in recorder.lines(0)
               if (m := re.match(r"DONE step (\d+) world 3", line))]
    assert resumed in (list(range(11, 21)), list(range(16, 21)))
    got, logged = result.values[0]  # other world sizes add up the global batch otherwise
    want, want_logged = _reference(recorder)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for (step, epoch, loss), (want_step, want_epoch, want_loss) in zip(
            logged, want_logged, strict=True):
        assert (step, epoch) == (want_step, want_epoch)
        assert loss == pytest.approx(want_loss, rel=1e-5)


def test_the_readme_example_trains_and_commits(ip, tmp_path, log_dir, monkeypatch, capsys):
    line, cell = readme.magic(readme.block("%%elastic --nproc 2 --max-nproc 3").text)
    monkeypatch.chdir(tmp_path)  # its output_dir
    result = ip.run_cell_magic(
        "elastic", f"{line} --preload transformers.trainer --text --log-dir {log_dir}", cell)
    assert result.ok and result.world_size == 2, result
    # 480 samples in global batches of 24, 2 epochs: 40 steps, committed every 10
    assert {rank: value.global_step for rank, value in result.values.items()} == {0: 40, 1: 40}
    assert result.commit is not None and result.commit["step"] == 30
    assert "[elastic] succeeded" in capsys.readouterr().out
