"""Starting ranks: a warm launch (a cell after the first), the first cell after
``%load_ext``, and recovery after a rank exits.

Every side runs the same user code: make the gloo process group, then write the time.
- elastic_magic warm: ``launch()`` in this process, after one launch (the pool is warm);
- elastic_magic first cell: a fresh IPython shell runs ``%load_ext elastic_magic``, then
  the cell, timed from the cell's start;
- torchrun: ``torchrun --standalone``, from the command's start (what a user waits for);
- accelerate's ``notebook_launcher``: forks this process (which has imported torch), from
  the call; it cannot launch once CUDA is initialised here, elastic_magic can.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from .common import free_port, launch, now, scratch, stamps, torchrun, warm_up

USER_CODE = textwrap.dedent("""
    import os, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    with open(os.path.join(OUT, "up" + os.environ["RANK"]), "w") as f:
        f.write(repr(time.time()))
    dist.destroy_process_group()
""")
SCRIPT = "import sys\nOUT = sys.argv[1]\n"  # the same code as a torchrun script

# A real IPython shell: %load_ext, then the first %%elastic cell, timed from its start.
FIRST_CELL = textwrap.dedent("""
    import sys, time
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "elastic_magic")
    shell.user_ns["OUT"] = sys.argv[3]
    print(time.time(), flush=True)
    shell.run_cell_magic("elastic", f"--nproc {sys.argv[2]} --no-init", sys.argv[1])
""")

# Rank 1 exits in the first attempt; the time from its exit to every rank of the second
# attempt in user code.
RECOVERY = textwrap.dedent("""
    import os, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], dist.get_rank()
    with open(os.path.join(OUT, f"up{attempt}_{rank}"), "w") as f:
        f.write(repr(time.time()))
    if attempt == "0":
        dist.barrier()
        if rank == 1:
            with open(os.path.join(OUT, "exit"), "w") as f:
                f.write(repr(time.time()))
            os._exit(1)
        time.sleep(60)
    dist.destroy_process_group()
""")


def _script(code: str) -> Path:
    path = scratch() / "user_code.py"
    path.write_text(SCRIPT + code)
    return path


def _ours_warm(nproc: int) -> float:
    warm_up("1", nproc)  # a cell after the first: only the first pays for the pool
    out = scratch()
    started = now()
    launch(USER_CODE, nproc, namespace={"OUT": str(out)}, init_process_group=False)
    return max(stamps(out, "up")) - started


def _ours_first_cell(nproc: int) -> float:
    out = scratch()
    proc = subprocess.run([sys.executable, "-c", FIRST_CELL, USER_CODE, str(nproc), str(out)],
                          capture_output=True, text=True, check=True, timeout=300)
    return max(stamps(out, "up")) - float(proc.stdout.split()[0])


def _torchrun(nproc: int, code: str, *torchrun_args: str,
              env: dict[str, str] | None = None) -> tuple[Path, float]:
    out, script = scratch(), _script(code)
    started = now()
    torchrun(script, nproc, str(out), torchrun_args=torchrun_args, env=env)
    return out, started


def _stamp_rank(out: str) -> None:
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    with open(os.path.join(out, "up" + os.environ["RANK"]), "w") as f:
        f.write(repr(time.time()))
    dist.destroy_process_group()


def _notebook_launcher(nproc: int) -> float:
    from accelerate import notebook_launcher

    out = scratch()
    started = now()
    with contextlib.redirect_stdout(io.StringIO()):  # "Launching training on ..."
        notebook_launcher(_stamp_rank, (str(out),), num_processes=nproc,
                          use_port=str(free_port()))
    return max(stamps(out, "up")) - started


def warm_launch(nproc: int, quick: bool) -> dict[str, float]:
    out, started = _torchrun(nproc, USER_CODE)
    return {"elastic_magic": _ours_warm(nproc),
            "torchrun": max(stamps(out, "up")) - started,
            "notebook_launcher": _notebook_launcher(nproc)}


def first_cell(nproc: int, quick: bool) -> dict[str, float]:
    out, started = _torchrun(nproc, USER_CODE)
    return {"elastic_magic": _ours_first_cell(nproc),
            "torchrun": max(stamps(out, "up")) - started}


def recovery(nproc: int, quick: bool) -> dict[str, float]:
    """torchrun as the issue has it (``--max-restarts 1 --monitor-interval 0.1``), with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: as shipped, about half its restarts hang
    (restarted ranks meet the dead attempt's keys in torch's shared store)."""
    ours = scratch()
    launch(RECOVERY, nproc, namespace={"OUT": str(ours)}, max_restarts=1,
           init_process_group=False)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    theirs, _ = _torchrun(nproc, RECOVERY, "--max-restarts=1", "--monitor-interval=0.1",
                          env=env)
    return {side: max(stamps(out, "up1_")) - stamps(out, "exit")[0]
            for side, out in (("elastic_magic", ours), ("torchrun", theirs))}
