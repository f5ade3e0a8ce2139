"""Every performance scenario beside its competitor, interleaved, N repeats.

    python -m benchmarks                       # everything, --repeat 5
    python -m benchmarks --repeat 1 --quick    # smaller workloads: proves each one runs
    python -m benchmarks --only warm_launch,recovery --repeat 7

Each repeat runs every selected scenario once, and each scenario runs its sides back to
back (the competitor in the same conditions). The table gives, per side, the median and
the min-max over the repeats, and the ratio of elastic_magic's median to the competitor's.
The JSON (every value of every repeat, the machine, the command) goes to
``benchmarks/results/`` unless --json says otherwise. Run it on a quiet machine: the
figures are only worth what the machine's noise allows.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import (
    cells,
    cluster,
    common,
    detach,
    elastic,
    frameworks,
    join,
    launch,
    leave,
    memory,
    session,
    state,
    survivors,
    throughput,
    training,
)

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[int, bool], dict[str, float]]  # (nproc, quick) -> side: value
    unit: str
    competitor: str | None  # the side elastic_magic's ratio is taken against
    goal: str
    higher_is_better: bool = False
    also: tuple[str, ...] = ()  # further competitors, each with its own ratio
    needs: tuple[str, ...] = ()  # modules of the bench extra it imports (its competitors)


SCENARIOS = (
    Scenario("warm_launch", launch.warm_launch, "s", "torchrun",
             "<= 0.1x torchrun; within 2x notebook_launcher", needs=("accelerate",)),
    Scenario("first_cell", launch.first_cell, "s", "torchrun", "<= 1.0x torchrun"),
    Scenario("detach_launch", detach.detach_launch, "s", "in_kernel",
             "within 1.1x the agent in the kernel", also=("torchrun",)),
    Scenario("detach_recovery", detach.detach_recovery, "s", "in_kernel",
             "within 1.1x the agent in the kernel"),
    Scenario("attach", detach.attach, "s", None,
             "<= 1 s to a current dashboard (2 ranks printed 1M lines)"),
    Scenario("recovery", launch.recovery, "s", "torchrun", "<= 0.2x torchrun"),
    Scenario("resize", elastic.resize, "s", "torchrun_relaunch", "<= 0.5 s"),
    Scenario("commit", elastic.commit, "s", "torch_save_fsync", "<= 0.5x torch.save+fsync"),
    Scenario("ddp", throughput.ddp, "steps/s", "torchrun", ">= 0.98x torchrun",
             higher_is_better=True),
    Scenario("log_overhead", throughput.log_overhead, "steps/s", "without_log",
             ">= 0.99x without elastic_magic.log", higher_is_better=True),
    Scenario("output", throughput.output, "s", "torchrun", "<= 1.1x torchrun, none lost"),
    Scenario("memory", memory.memory, "MB / CPU s", None, "idle pool: no CPU"),
    Scenario("join", join.join, "s", "torchrun_unshared_store", "<= 1 s beyond worker start"),
    Scenario("cluster_grow", cluster.cluster_grow, "s", "sbatch_join_by_hand",
             "<= 1.0x sbatch + join by hand (root: the tests' Slurm in namespaces)"),
    Scenario("leave", leave.leave, "s", None, "regroup (to started) <= 1 s"),
    Scenario("session_cell", session.session_cell, "ms", "ipyparallel_px",
             "<= 1.0x ipyparallel %px", needs=("ipyparallel",)),
    Scenario("session_allreduce", session.session_allreduce, "ms", "ipyparallel_px",
             "<= 1.0x ipyparallel %px", needs=("ipyparallel",)),
    Scenario("session_start", session.session_start, "s", "ipyparallel_cluster", "report",
             needs=("ipyparallel",)),
    Scenario("session_reform", session.session_reform, "s", None,
             "<= 0.5 s beyond the setup cell"),
    Scenario("train_mlp", training.train_mlp, "s", "torchrun",
             "<= 0.1x torchrun; <= 0.25x notebook_launcher", also=("notebook_launcher",),
             needs=("accelerate",)),
    Scenario("train_lightning", training.train_lightning, "s", "torchrun", "<= 0.2x torchrun",
             needs=("pytorch_lightning",)),
    Scenario("train_hf", training.train_hf, "s", "torchrun", "<= 0.2x torchrun",
             needs=("transformers",)),
    Scenario("train_recovery", training.train_recovery, "s", "torchrun", "<= 0.2x torchrun"),
    Scenario("lightning_recovery", frameworks.lightning_recovery, "s", "torchrun",
             "<= 0.1x torchrun resuming from Lightning's last checkpoint; steps lost <= the "
             "commit interval", needs=("pytorch_lightning",)),
    Scenario("hf_recovery", frameworks.hf_recovery, "s", "torchrun",
             "<= 0.1x torchrun resuming from HF's last checkpoint; steps lost <= the commit "
             "interval", needs=("transformers",)),
    Scenario("train_resize", training.train_resize, "s", None, "<= 0.5 s"),
    Scenario("train_recovery_survivors", training.train_recovery_survivors, "s", "torchrun",
             "survivors: <= 0.15 s and <= 0.1x torchrun"),
    Scenario("train_resize_survivors", training.train_resize_survivors, "s", None,
             "survivors: <= 0.3 s"),
    Scenario("survivors_model_size", survivors.survivors_model_size, "s", None,
             "survivors: recovery independent of model size (10 MB, 1 GB; reported)"),
    Scenario("survivors_efficiency", survivors.survivors_efficiency,
             "useful/undisturbed steps", "torchrun",
             "(reported) a failure every 10 s for 5 min", higher_is_better=True),
    Scenario("session_train", training.session_train, "s", "ipyparallel_px",
             "(reported)", needs=("ipyparallel",)),
    Scenario("session_train_reform", training.session_train_reform, "s", None,
             "(reported)"),
    Scenario("state_commit", state.state_commit, "s", "dcp_async_save",
             "<= 0.5x dcp.async_save's blocking time", also=("dcp_save",)),
    Scenario("state_restore", state.state_restore, "s", "dcp_load", "(reported)"),
    Scenario("state_overhead", state.state_overhead, "steps/s", "without_state",
             ">= 0.95x without State (commit every 10 steps)", higher_is_better=True),
    Scenario("state_kernel_rss", state.state_kernel_rss, "MB", "without_state",
             "<= 1.0x without State (peak)"),
)


def main() -> None:
    names = [s.name for s in SCENARIOS]
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default=",".join(names),
                        help=f"comma-separated scenarios (default all: {', '.join(names)})")
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    chosen = [name.strip() for name in opts.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; the scenarios are: "
                     f"{', '.join(names)}")
    scenarios = [s for s in SCENARIOS if s.name in chosen]
    missing = [f"{s.name} needs {', '.join(lacking)}" for s in scenarios
               if (lacking := [m for m in s.needs if importlib.util.find_spec(m) is None])]
    if missing:
        parser.error(f"{'; '.join(missing)} (the competitors), not installed: pip install -c "
                     "constraints/ci.txt -e '.[bench]', or leave them out with --only")

    import torch

    cells.set_env()  # before any pool starts: every scenario runs in the same environment
    runs: dict[str, dict[str, list[float]]] = {s.name: {} for s in scenarios}
    errors: dict[str, list[str]] = {}
    for repeat in range(opts.repeat):
        for scenario in scenarios:
            started = time.monotonic()
            try:
                common.settle_pool()  # none starts beside a rebuild the one before began
                values = scenario.run(opts.nproc, opts.quick)
            except Exception:
                errors.setdefault(scenario.name, []).append(traceback.format_exc())
                print(f"[{repeat + 1}/{opts.repeat}] {scenario.name}: failed", file=sys.stderr)
                continue
            for side, value in values.items():
                runs[scenario.name].setdefault(side, []).append(value)
            print(f"[{repeat + 1}/{opts.repeat}] {scenario.name} "
                  f"({time.monotonic() - started:.0f} s): "
                  + ", ".join(f"{k} {v:.3g}" for k, v in values.items()), file=sys.stderr)
    table = summarise(scenarios, runs)
    print_table(table, opts)
    for name, tracebacks in errors.items():
        print(f"\n{name} failed {len(tracebacks)}x; the last error:\n{tracebacks[-1]}")
    report = {
        "command": " ".join(["python -m benchmarks", *sys.argv[1:]]),
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "load_average": os.getloadavg()},
        "repeat": opts.repeat, "quick": opts.quick, "nproc": opts.nproc,
        "runs": runs, "summary": table, "errors": errors,
    }
    path = opts.json or RESULTS / f"bench-{report['time'].replace(':', '')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\nJSON: {path}")


def summarise(scenarios: list[Scenario],
              runs: dict[str, dict[str, list[float]]]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for scenario in scenarios:
        sides = runs[scenario.name]
        medians = {side: _median(values) for side, values in sides.items()}
        for side, values in sides.items():
            done = [v for v in values if not math.isnan(v)]
            ratios: dict[str, float] = {}
            for competitor in filter(None, (scenario.competitor, *scenario.also)):
                base = medians.get(_counterpart(side, competitor, medians))
                if base and not math.isnan(base) and side.startswith("elastic_magic") \
                        and not math.isnan(medians[side]):
                    ratios[competitor] = medians[side] / base
            ratio = ratios.get(scenario.competitor or "")
            rows.append({"scenario": scenario.name, "side": side, "unit": scenario.unit,
                         "median": medians[side], "min": min(done) if done else None,
                         "max": max(done) if done else None, "failed": len(values) - len(done),
                         "ratio": ratio, "ratios": ratios,
                         "goal": scenario.goal})
    return rows


def _counterpart(side: str, competitor: str, sides: dict[str, float]) -> str:
    """The competitor's side to compare ``side`` with: the one with the same suffix
    (``elastic_magic_session_cell`` with ``ipyparallel_px_cell``) where there is one."""
    words = side.split("_")
    for start in range(1, len(words)):
        twin = "_".join([competitor, *words[start:]])
        if twin in sides:
            return twin
    return competitor


def _median(values: list[float]) -> float:
    done = [v for v in values if not math.isnan(v)]
    return statistics.median(done) if done else math.nan


def print_table(rows: list[dict[str, object]], opts: argparse.Namespace) -> None:
    print(f"\nmedians of {opts.repeat} (min-max), {opts.nproc} ranks, {os.cpu_count()} CPUs"
          f"{', --quick' if opts.quick else ''}")
    header = f"{'scenario':20} {'side':34} {'median':>9} {'min-max':>17} {'ratio':>7}  goal"
    print(header)
    print("-" * len(header))
    last = None
    for row in rows:
        scenario = row["scenario"] if row["scenario"] != last else ""
        last = row["scenario"]
        spread = f"{row['min']:.3g}-{row['max']:.3g}" if row["min"] is not None else "-"
        ratios: dict[str, float] = row["ratios"]  # type: ignore[assignment]
        ratio = "; ".join(f"{r:.2f}x" for r in ratios.values())
        failed = f" ({row['failed']} failed)" if row["failed"] else ""
        goal = row["goal"] if scenario else ""
        print(f"{scenario!s:20} {row['side']!s:34} {row['median']:9.3g} {spread:>17} "
              f"{ratio:>7}  {goal}{failed}")


if __name__ == "__main__":
    main()
