"""Work while a job runs: DDP training speed, and a flood of output.

- DDP: a 1.05M-parameter MLP (one 1024x1024 Linear), batch 64, SGD, gloo, 2 ranks;
  steps per second over the timed steps (higher is better). The kernel's agent, pumps and
  polling share the workers' cores: this is where they would show. ``log_overhead``: the
  same with ``elastic_magic.log`` every step, beside it without.
- Output: each of 2 ranks prints its share of 1M lines; seconds from the first print to
  the last rank's last print (a pipe that is not drained in time blocks the printing rank),
  and every line must arrive (elastic_magic: its per-rank logs; torchrun: ``--redirects 3
  --log-dir``, its workers writing to files).
"""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

from .common import launch, scratch, stamps, torchrun, warm_up

_log_runs = itertools.count()

DDP = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    if LOG:
        import elastic_magic
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1024, 1024))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)

    def step():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if LOG:
            elastic_magic.log(loss=loss.item())

    for _ in range(20):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(STEPS):
        step()
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "rate"), "w") as f:
            f.write(repr(STEPS / (time.perf_counter() - started)))
""")

OUTPUT = textwrap.dedent("""
    import os, sys, time
    rank = int(os.environ["RANK"])
    started = time.time()
    for i in range(LINES):
        print(f"rank {rank} line {i}")
    sys.stdout.flush()
    for name, value in (("start", started), ("end", time.time())):
        with open(os.path.join(OUT, f"{name}{rank}"), "w") as f:
            f.write(repr(value))
""")


def _script(code: str, **constants: object) -> str:
    header = "import sys\nOUT = sys.argv[1]\n" + "".join(
        f"{name} = {value!r}\n" for name, value in constants.items())
    path = scratch() / "user_code.py"
    path.write_text(header + code)
    return str(path)


def ddp(nproc: int, quick: bool) -> dict[str, float]:
    steps = 100 if quick else 400
    ours, theirs = scratch(), scratch()
    warm_up(DDP, nproc, namespace={"OUT": str(scratch()), "STEPS": 1, "LOG": False},
            init_process_group=False)  # what DDP imports is in the pool, as in a later cell
    launch(DDP, nproc, namespace={"OUT": str(ours), "STEPS": steps, "LOG": False},
           init_process_group=False)
    torchrun(Path(_script(DDP, STEPS=steps, LOG=False)), nproc, str(theirs))
    return {"elastic_magic": stamps(ours, "rate")[0], "torchrun": stamps(theirs, "rate")[0]}


def log_overhead(nproc: int, quick: bool) -> dict[str, float]:
    """The DDP cell with ``elastic_magic.log(loss=loss.item())`` every step, beside the same
    cell without it, each in a job: steps per second (every point must arrive)."""
    steps = 100 if quick else 400
    rates = {}
    sides = [("elastic_magic", True), ("without_log", False)]
    for side, log in sides if next(_log_runs) % 2 == 0 else sides[::-1]:  # neither first always
        out = scratch()
        result = launch(DDP, nproc, namespace={"OUT": str(out), "STEPS": steps, "LOG": log},
                        init_process_group=False)
        logged = len(result.metrics.get("loss", ()))
        if logged != (steps + 20 if log else 0):  # the warm-up's steps log too
            raise RuntimeError(f"{side}: {logged} of {steps + 20} points arrived")
        rates[side] = stamps(out, "rate")[0]
    return rates


def output(nproc: int, quick: bool) -> dict[str, float]:
    lines = (100_000 if quick else 1_000_000) // nproc
    ours, theirs, logs = scratch(), scratch(), scratch()
    result = launch(OUTPUT, nproc, namespace={"OUT": str(ours), "LINES": lines},
                    init_process_group=False)
    ours_lines = sum(1 for path in result.log_dir.rglob("stdout.log")
                     for _ in path.open())
    torchrun(Path(_script(OUTPUT, LINES=lines)), nproc, str(theirs),
             torchrun_args=("--redirects=3", f"--log-dir={logs}"))
    theirs_lines = sum(1 for path in logs.rglob("stdout.log") for _ in path.open())
    for side, count in (("elastic_magic", ours_lines), ("torchrun", theirs_lines)):
        if count != lines * nproc:
            raise RuntimeError(f"{side}: {count} of {lines * nproc} lines arrived")
    return {side: max(stamps(out, "end")) - min(stamps(out, "start"))
            for side, out in (("elastic_magic", ours), ("torchrun", theirs))}
