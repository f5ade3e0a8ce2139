"""Launch latency: cell start to every rank running user code, against torchrun.

The same user code (init the gloo process group, then record the time) runs under
``torchrun --standalone`` and under elastic_magic, interleaved, N times each, in one run:

- torchrun: from the command's start (what a user waits for at a terminal);
- elastic_magic, warm: from ``launch()`` in a process that has already imported torch and
  elastic_magic, as a notebook kernel has after ``%load_ext``;
- elastic_magic, cold: a fresh interpreter that imports elastic_magic and launches, the
  like-for-like comparison with torchrun's own interpreter start.

Usage: python benchmarks/launch_latency.py [--nproc 2] [--repeat 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

USER_CODE = """
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
started = time.time()
with open(os.path.join(os.environ["BENCH_OUT"], "rank" + os.environ["RANK"]), "w") as f:
    f.write(repr(started))
dist.destroy_process_group()
"""

COLD_LAUNCH = """
import sys, elastic_magic
elastic_magic.launch(open(sys.argv[1]).read(), nproc=int(sys.argv[2]),
                     init_process_group=False, render=lambda events: None)
"""


def _last_rank_started(out_dir: Path, nproc: int) -> float:
    stamps = [float((out_dir / f"rank{r}").read_text()) for r in range(nproc)]
    return max(stamps)


def _fresh_out() -> Path:
    path = Path(tempfile.mkdtemp(prefix="em-bench-"))
    os.environ["BENCH_OUT"] = str(path)
    return path


def torchrun(script: Path, nproc: int) -> float:
    out = _fresh_out()
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(nproc), str(script)],
                   check=True, capture_output=True)
    return _last_rank_started(out, nproc) - t0


def elastic_warm(nproc: int) -> float:
    import elastic_magic

    out = _fresh_out()
    t0 = time.time()
    elastic_magic.launch(USER_CODE, nproc=nproc, init_process_group=False,
                         render=lambda events: None)
    return _last_rank_started(out, nproc) - t0


def elastic_cold(script: Path, nproc: int) -> float:
    out = _fresh_out()
    t0 = time.time()
    subprocess.run([sys.executable, "-c", COLD_LAUNCH, str(script), str(nproc)],
                   check=True, capture_output=True)
    return _last_rank_started(out, nproc) - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()

    import torch  # noqa: F401

    import elastic_magic  # noqa: F401  (warm: the kernel has it loaded)

    script = Path(tempfile.mkdtemp(prefix="em-bench-")) / "user_code.py"
    script.write_text(USER_CODE)
    elastic_warm(opts.nproc)  # first launch pays for OS file caches; not counted
    runs: dict[str, list[float]] = {"torchrun": [], "elastic_warm": [], "elastic_cold": []}
    for _ in range(opts.repeat):
        runs["torchrun"].append(torchrun(script, opts.nproc))
        runs["elastic_warm"].append(elastic_warm(opts.nproc))
        runs["elastic_cold"].append(elastic_cold(script, opts.nproc))
    median = {name: statistics.median(values) for name, values in runs.items()}
    report = {
        "nproc": opts.nproc,
        "repeat": opts.repeat,
        "cpus": os.cpu_count(),
        "seconds": runs,
        "median_s": median,
        "ratio_warm_vs_torchrun": median["elastic_warm"] / median["torchrun"],
        "ratio_cold_vs_torchrun": median["elastic_cold"] / median["torchrun"],
    }
    print(f"launch to every rank running user code, {opts.nproc} ranks, median of {opts.repeat}")
    for name, value in median.items():
        print(f"  {name:13s} {value:6.2f} s")
    print(f"  elastic_magic (warm kernel) / torchrun = {report['ratio_warm_vs_torchrun']:.2f}x")
    print(f"  elastic_magic (cold start)  / torchrun = {report['ratio_cold_vs_torchrun']:.2f}x")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
