"""The training cells the training scenarios run, and how each side runs one.

Every cell is plain torchrun-style code that reads a few globals (``OUT``: the folder for
its timestamps, ``STEPS``, ``SAMPLES``) and calls ``stamp(tag)`` right after its first
``optimizer.step()``: each rank writes ``time.time()`` to ``OUT/<tag>_<RANK>``, and a figure
is the latest rank's stamp minus the moment the user started the cell (same clock, same
machine). The same source runs as a cell (``launch``), as a ``torchrun --standalone``
script (the globals from ``argv``), and under accelerate's ``notebook_launcher`` (exec'd in
the forked children).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from .common import free_port, now, scratch, stamps, torchrun

STAMP = textwrap.dedent("""
    def stamp(tag):
        import os, time
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_world_size() != int(os.environ["WORLD_SIZE"]):
            raise RuntimeError("this step was not taken in the job's process group")
        path = os.path.join(OUT, f"{tag}_{os.environ['RANK']}")
        with open(path + ".tmp", "w") as f:  # renamed: a reader never sees it half written
            f.write(repr(time.time()))
        os.replace(path + ".tmp", path)
""")

# (a) a DDP MLP with AdamW, fed by elastic_magic.DataLoader with 2 loader workers.
# Its objects, without the process group (made where DDP first uses it) ...
MLP_OBJECTS = textwrap.dedent("""
    import torch, torch.distributed as dist, elastic_magic
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 32), torch.randn(SAMPLES, 1))
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sampler = elastic_magic.ElasticSampler(len(data), global_batch_size=48, seed=0)
    loader = elastic_magic.DataLoader(data, batch_sampler=sampler, num_workers=2)

    def step_of(model, x, y):  # one step of ``model`` (net, wrapped by DDP)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
""")
# ... and the cell as torchrun scripts have it: the group made first, DDP, one step.
MLP_SETUP = textwrap.dedent("""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
""") + MLP_OBJECTS + textwrap.dedent("""
    model = DDP(net)

    def train_step(x, y):
        step_of(model, x, y)
""")
MLP_TRAIN = textwrap.dedent("""
    for step, (x, y) in enumerate(loader):
        train_step(x, y)
        if step == 0:
            stamp("step")
        if step + 1 == STEPS:
            break
""")
MLP = MLP_SETUP + MLP_TRAIN + "del loader\ndist.destroy_process_group()\n"

# (a) killed: in the first attempt rank 1 SIGKILLs itself after the first step; the
# restart trains from the top (no State: the same script as under torchrun).
MLP_KILLED = MLP_SETUP + textwrap.dedent("""
    import os, signal, time
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    for step, (x, y) in enumerate(loader):
        train_step(x, y)
        if step == 0:
            stamp(f"step{attempt}")
        if attempt == "0":
            dist.barrier()
            if dist.get_rank() == 1:
                stamp("kill")
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        if step + 1 == STEPS:
            break
    del loader
    dist.destroy_process_group()
""")

# (a) killed, with a State committing every step: in the first attempt rank 1 SIGKILLs
# itself after the first step's commit, and rank 0 waits; the group goes on from that
# commit, its survivors staying (--survivors) or every rank starting again. Each attempt
# stamps its first step as ``step<restart count>``.
MLP_KILLED_STATE = MLP_SETUP + textwrap.dedent("""
    import os, signal, time
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    state = elastic_magic.State(model=model, optimizer=optimizer, loader=loader, step=0)
    first = True
    while state.step < STEPS:
        sampler.set_epoch(state.step // (SAMPLES // 48))
        for x, y in loader:
            train_step(x, y)
            if first:
                stamp(f"step{attempt}")
                first = False
            state.step += 1
            state.commit()
            if attempt == "0":
                dist.barrier()
                if dist.get_rank() == 1:
                    stamp("kill")
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            if state.step >= STEPS:
                break
    del loader
    dist.destroy_process_group()
""")

# (a) going on in place (``@elastic_magic.run``): the model, optimizer and loader are made
# once per process, DDP (tied to the group) in the function. KILL: as MLP_KILLED_STATE, at
# the commit of step KILL_AT (1: the first; later, a failure in a training that has run a
# while: the pool's spares refilled, the loaders' workers running). RESIZE: as MLP_ELASTIC
# (~20 ms of work a step, first steps stamped ``w<world size>``).
MLP_IN_PLACE = MLP_OBJECTS + textwrap.dedent("""
    import os, signal, time
    state = elastic_magic.State(model=net, optimizer=optimizer, loader=loader, step=0)

    @elastic_magic.run
    def train(state):
        model = DDP(net)
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        first = True
        while state.step < STEPS:
            sampler.set_epoch(state.step // (SAMPLES // 48))
            for x, y in loader:
                step_of(model, x, y)
                if first:
                    stamp(f"w{dist.get_world_size()}" if RESIZE else f"step{attempt}")
                    first = False
                if RESIZE:
                    time.sleep(0.02)
                state.step += 1
                state.commit()
                if KILL and attempt == "0" and state.step >= KILL_AT:
                    dist.barrier()
                    if dist.get_rank() == 1:
                        stamp("kill")
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(60)
                if state.step >= STEPS:
                    break

    train(state)
    del loader
    dist.destroy_process_group()
""")

# (a) with an elastic State, committing every step (~20 ms of work a step) until resized:
# each run stamps its first step as ``w<world size>``.
MLP_ELASTIC = MLP_SETUP + textwrap.dedent("""
    import time
    state = elastic_magic.State(model=model, optimizer=optimizer, loader=loader, step=0)
    first = True
    while state.step < 100000:
        sampler.set_epoch(state.step // (SAMPLES // 48))
        for x, y in loader:
            train_step(x, y)
            if first:
                stamp(f"w{dist.get_world_size()}")
                first = False
            time.sleep(0.02)
            state.step += 1
            state.commit()
""")

# A small LightningModule (the launch and the recovery benchmarks both train it).
LIGHTNING_NET = textwrap.dedent("""
    import os, torch, pytorch_lightning as pl
    from torch import nn

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
""")

# (b) PyTorch Lightning, strategy="ddp": it finds torchrun's variables and makes the group.
LIGHTNING = LIGHTNING_NET + textwrap.dedent("""
    class FirstStep(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 0:
                stamp("step")

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 32), torch.randn(SAMPLES, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                         strategy="ddp", max_steps=STEPS, callbacks=[FirstStep()],
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, default_root_dir=OUT)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=24))
""")

# (c) a HuggingFace Trainer on a 1-layer GPT-2 built from a config (no download).
HF = textwrap.dedent("""
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                              TrainingArguments)

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                stamp("step")

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                       n_head=2))
    ids = torch.randint(0, 64, (SAMPLES, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=8, max_steps=STEPS,
                             use_cpu=True, ddp_backend="gloo", report_to="none",
                             save_strategy="no", logging_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[FirstStep()]).train()
""")

# Both sides run with these (and OMP_NUM_THREADS=1, which both set for 2 ranks anyway).
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def set_env() -> None:
    """The benchmark's own environment, which the pool's workers inherit (set once: a
    change rebuilds the pool)."""
    for name, value in ENV.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def params(quick: bool, **extra: int) -> dict[str, int]:
    return {"STEPS": 2 if quick else 5, "SAMPLES": 480, **extra}


def namespace(out: Path, values: dict[str, int]) -> dict[str, object]:
    return {"OUT": str(out), **values}


def script(code: str, values: dict[str, int]) -> Path:
    """The cell as a torchrun script: ``OUT`` from argv, the rest as constants."""
    path = scratch() / "train.py"
    path.write_text("import os, sys\nOUT = sys.argv[1]\n"
                    + "".join(f"{k} = {v!r}\n" for k, v in values.items()) + STAMP + code)
    return path


def run_torchrun(code: str, nproc: int, values: dict[str, int], *torchrun_args: str,
                 env: dict[str, str] | None = None) -> tuple[Path, float]:
    """The folder the ranks stamped, and when the command started."""
    out, path = scratch(), script(code, values)
    started = now()
    torchrun(path, nproc, str(out), torchrun_args=torchrun_args,
             env={**os.environ, **ENV, **(env or {})})
    return out, started


def every(out: Path, tag: str, nproc: int) -> list[float]:
    """The ``tag`` stamps of all ``nproc`` ranks (an error if a rank did not write one)."""
    done = stamps(out, f"{tag}_")
    if len(done) != nproc:
        raise RuntimeError(f"{len(done)} of {nproc} ranks stamped {tag!r} in {out}")
    return done


def first_step(out: Path, started: float, nproc: int, tag: str = "step") -> float:
    """From ``started`` to the first step done on every one of ``nproc`` ranks."""
    return max(every(out, tag, nproc)) - started


# A fresh Python process stands in for a kernel that imported torch and accelerate but never
# built DDP; the time is taken at the call, and its forked children exec the cell.
LAUNCHER = textwrap.dedent("""
    import sys, time
    import torch
    from accelerate import notebook_launcher
    import json
    code, nproc, out, port, values = sys.argv[1:6]

    def train(out):
        exec(compile(code, "<cell>", "exec"),
             {"__name__": "__main__", "OUT": out, **json.loads(values)})

    print(time.time(), flush=True)
    notebook_launcher(train, (out,), num_processes=int(nproc), use_port=port)
""")


def notebook_launcher(code: str, nproc: int, values: dict[str, int]) -> float:
    """The stand-in kernel in its own session (its forked ranks killed with it on timeout)."""
    out = scratch()
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, STAMP + code, str(nproc), str(out),
         str(free_port()), json.dumps(values)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **ENV}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode:
        raise RuntimeError(f"notebook_launcher failed:\n{stderr[-3000:]}")
    return first_step(out, float(stdout.split()[0]), nproc)
