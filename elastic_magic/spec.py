"""JobSpec: everything a launch needs, validated before anything starts.

Every job option is declared once, in ``OPTIONS`` (name, flag, default, help, check, and
whether a joining machine sets it or takes the head's); the %%elastic flags and help,
``launch(**options)`` and the joining machine's spec derive from it.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import logs
from .checks import (
    SpecError,
    argv_words,
    backend_name,
    default_log_dir,
    gpu_count,
    interval,
    module_names,
    optional_count,
    own_dir,
    parse_endpoint,
    parse_env,
    parse_nnodes,
    resolve_nproc,
    seconds,
    usable_dir,
    variable_names,
    zero_or_more,
)


@dataclass(frozen=True)
class Option:
    """One job option. ``per_machine``: a machine that joins sets it itself (its own
    workers, GPUs, folders); otherwise it runs the job as the head declared it."""

    name: str  # keyword of JobSpec.create and launch
    flag: str | None  # the %%elastic flag; None: Python only
    default: Any  # shown in the help unless None (None: worked out, as the help says)
    help: str
    metavar: str | None = None
    # (flag, flag text or Python value) -> the value kept; raises SpecError
    check: Callable[[str, Any], Any] = lambda _, value: value
    per_machine: bool = False
    action: str | None = None  # argparse's, where the flag takes no value or repeats
    read: Callable[[JobSpec], Any] | None = None  # the head's value; default: spec.<name>

    @property
    def label(self) -> str:
        return self.flag or self.name

    @property
    def help_text(self) -> str:
        shown = self.default is not None and not isinstance(self.default, bool)
        return f"{self.help} (default {self.default})" if shown else self.help

    def argument(self) -> tuple[tuple[str, ...], dict[str, Any]]:
        """``add_argument`` arguments for %%elastic. A flag left out stays out of the
        namespace, so defaults come from this table alone."""
        kwargs: dict[str, Any] = dict(dest=self.name, default=argparse.SUPPRESS,
                                      help=self.help_text)
        if self.action:
            kwargs["action"] = self.action
        if self.action not in ("store_false", "store_true"):  # flags without a value
            kwargs["metavar"] = self.metavar
        return (self.flag or "",), kwargs


OPTIONS: tuple[Option, ...] = (
    Option("nproc", "--nproc", None, "workers on this machine: N, auto, cpu or gpu "
           "(default: one per GPU, or 1 without GPUs)", "N|auto|cpu|gpu", per_machine=True),
    Option("min_nproc", "--min-nproc", None, "fewest workers a resize may leave (default: "
           "--nproc)", "N", optional_count, per_machine=True),
    Option("max_nproc", "--max-nproc", None, "most workers a resize may start (default: "
           "--nproc)", "N", optional_count, per_machine=True),
    Option("backend", "--backend", "auto", "process-group backend: auto (nccl with CUDA, "
           "else gloo), gloo or nccl", "auto|gloo|nccl", backend_name),
    Option("init_process_group", "--no-init", True, "never make the process group for the "
           "cell (by default it is made when the cell first uses it, unless the cell calls "
           "init_process_group itself)", action="store_false", check=lambda _, v: bool(v)),
    Option("pool", "--no-pool", True, "start every worker as a fresh interpreter, not forked "
           "from the warm pool (a process that has imported torch, never CUDA)",
           action="store_false", check=lambda _, v: bool(v), per_machine=True),
    Option("preload", "--preload", None, "modules the warm pool imports before forking "
           "workers (comma-separated), beside torch's DDP and data loading and what this "
           "kernel's earlier cells imported; one that initialises CUDA or starts a thread is "
           "left out, and the status command says why", "MODULES", module_names),
    Option("timeout", "--timeout", 300.0, "seconds workers wait for each other: rendezvous "
           "and collectives", "S", seconds),
    Option("stall_timeout", "--stall-timeout", None, "a rank without progress for S seconds "
           "outside any collective has stalled: the job fails, naming it (default off)", "S",
           lambda flag, v: None if v is None else seconds(flag, v, above=2)),
    Option("max_restarts", "--max-restarts", 0, "restarts of the whole group after a "
           "failure", "N", zero_or_more),
    Option("survivors", "--survivors", False, "survivors stay: after a rank fails or at a "
           "resize, the ranks that are still healthy keep their processes, roll back to the "
           "last State commit and run the cell again from the top in the same process; only "
           "new ranks start (cells that use elastic_magic.State; others restart as without "
           "it; in a session, the healthy ranks keep their namespaces and only new ranks "
           "replay the setup cells); a rank that cannot leave within --link-timeout starts "
           "again. docs: Survivors stay", action="store_true", check=lambda _, v: bool(v)),
    Option("monitor_interval", "--monitor-interval", 0.1, "seconds between health checks "
           "of the workers", "S", interval),
    Option("env", "--env", None, "set an environment variable in the workers (repeatable)",
           "K=V", lambda _, v: parse_env(v), action="append"),
    Option("argv", "--args", None, "the cell's sys.argv[1:], as one string: \"--lr 0.1\"",
           "ARGS", argv_words),
    Option("pull", "--pull", None, "after success, copy these variables (comma-separated) "
           "from rank 0", "NAMES", variable_names),
    Option("nnodes", "--nnodes", None, "machines in the job, as torchrun's --nnodes (default "
           "1). Others join with the `elastic-magic join` command the cell prints",
           "N|MIN:MAX", lambda _, v: parse_nnodes(v),
           read=lambda spec: f"{spec.min_nodes}:{spec.max_nodes}"),
    Option("launcher", "--launcher", None, "with --nnodes: start the other machines through "
           "a scheduler (slurm, ssh, or one registered by entry point), grown toward MAX "
           "as allocations start and all cancelled when the job ends; options from --launch "
           "and the launcher config file (docs: Launchers)", "NAME",
           lambda _, v: None if v is None else str(v), per_machine=True),
    Option("launch", "--launch", None, "a launcher option (repeatable): hosts=A,B (ssh); "
           "partition=P, account=A, time=1:00:00 (slurm); see docs: Launchers",
           "KEY=VALUE", lambda _, v: _launch_options(v), action="append", per_machine=True),
    Option("link_timeout", "--link-timeout", 6.0, "with --nnodes: a machine that sends "
           "nothing, not even a heartbeat (every S/4 seconds), for S seconds is lost: the "
           "others regroup without it; a machine that loses the head stops its workers and "
           "exits. Joining machines take the head's value", "S",
           lambda flag, v: seconds(flag, v, above=0.2)),
    Option("last_call", "--last-call", 1.0, "with --nnodes: once MIN machines have joined a "
           "rendezvous round, how long it waits for more (torch's last_call_timeout). A round "
           "closes as soon as every machine linked to the head has joined it: this is the "
           "wait for machines still connecting, or slow to join. Joining machines take the "
           "head's value", "S", seconds),
    Option("rdzv_endpoint", "--rdzv-endpoint", None, "with --nnodes: this machine's address "
           "as the others reach it (the rendezvous listens there only; default 127.0.0.1, a "
           "port the OS picks)", "HOST[:PORT]", lambda _, v: parse_endpoint(v),
           per_machine=True),
    Option("log_dir", "--log-dir", None, "where full per-rank logs go (default: "
           "~/.cache/elastic_magic/logs, private to you and pruned as jobs start: the newest "
           f"{logs.KEEP_RUNS} runs of the last {logs.KEEP_DAYS:g} days are kept; a folder you "
           "give is never pruned)", "DIR",
           lambda flag, v: usable_dir(v, flag) if v else default_log_dir(), per_machine=True),
    Option("checkpoint_dir", "--checkpoint-dir", None, "also keep the last committed elastic "
           "State here (atomic writes; a folder only you can write, below folders only you or "
           "root can write); a job started with a checkpoint in it resumes from it", "DIR",
           lambda _, v: v or None, per_machine=True),  # checked in create (checkpoint_shared)
    Option("checkpoint_shared", "--checkpoint-shared", False, "let --checkpoint-dir "
           "lie below a folder that another user owns, or that others can write without the "
           "sticky bit (a team's folder): you trust them, as they could put another folder of "
           "yours at its name (its checkpoint is then refused: see --checkpoint-moved); a "
           "link there is still never followed", action="store_true",
           check=lambda _, v: bool(v), per_machine=True),
    Option("checkpoint_moved", "--checkpoint-moved", False, "resume from a checkpoint that "
           "is not the one its folder last held here: you moved, renamed or copied its "
           "folder since it was written, or put back an older copy (without this, such a "
           "checkpoint is refused: someone who can write a folder on the way may have put "
           "another of your folders in its place). docs: Security",
           action="store_true", check=lambda _, v: bool(v), per_machine=True),
    Option("detach", "--detach", False, "run the job's agent in a process of its own, "
           "not in the kernel: the job outlives the kernel's restart, crash or Ctrl-C (which "
           "detaches), and any kernel of yours on this machine follows it again with "
           "%%elastic attach", action="store_true", check=lambda _, v: bool(v),
           per_machine=True),
    Option("keep", "--keep", 86400.0, "with --detach: seconds an ended job's result waits "
           "for a kernel to take it, after which its agent leaves nothing behind", "S",
           seconds, per_machine=True),
    # Detected where the workers run; Python callers (tests) may state it.
    Option("gpus", None, None, "CUDA GPUs the workers may use (default: those visible)",
           check=gpu_count, per_machine=True),
)
def _launch_options(value: Any) -> dict[str, str]:
    from .launchers import parse_launch
    return parse_launch(value)


def _checked_launcher(name: str | None, flags: dict[str, str], max_nodes: int
                      ) -> dict[str, str]:
    """The launcher's options (config file, then flags), checked by the launcher."""
    if name is None:
        if flags:
            raise SpecError("--launch is for a --launcher: add --launcher slurm or ssh.")
        return {}
    if max_nodes == 1:
        raise SpecError(f"--launcher {name} starts other machines: add --nnodes MIN:MAX "
                        "(MAX above 1).")
    from .launchers import launcher_options
    return launcher_options(name, flags)


OPTION_NAMES = tuple(option.name for option in OPTIONS)


def flag_arguments() -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """``add_argument`` arguments for every option that has a flag, in table order."""
    return [option.argument() for option in OPTIONS if option.flag]


def options_help() -> str:
    """One line per option, for docstrings of the Python API."""
    return "\n".join(f"    {o.name} ({o.flag or 'Python only'}): "
                     f"{o.help_text.replace('%%', '%')}" for o in OPTIONS)


def _check_names(names: Iterable[str], valid: Iterable[str], what: str) -> None:
    """Unknown keywords are a TypeError, as Python's own, naming the ones that exist."""
    valid = tuple(valid)
    for name in names:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"unknown {what} {name!r}{hint}; the {what}s are: "
                            f"{', '.join(valid)}.")


@dataclass
class JobSpec:
    """A validated launch request. Build it with :meth:`create` (or :meth:`for_machine`);
    the options it takes are declared in ``OPTIONS``.

    Attributes:
        nproc: Workers on this machine (--nproc, resolved).
        backend: "gloo" or "nccl" (--backend, auto resolved).
        max_restarts: --max-restarts.
        monitor_interval: --monitor-interval, in seconds.
        timeout: --timeout, in seconds.
        stall_timeout: --stall-timeout, in seconds; None: off.
        init_process_group: False with --no-init.
        pool: False with --no-pool.
        preload: --preload's modules.
        log_dir: Where the runs' log folders go (--log-dir, or the default).
        env: --env's variables.
        argv: The cell's ``sys.argv[1:]`` (--args).
        pull: --pull's variable names.
        gpus: The CUDA GPUs the workers may use.
        min_nproc: --min-nproc (default: nproc).
        max_nproc: --max-nproc (default: nproc).
        checkpoint_dir: --checkpoint-dir, checked; None: no checkpoint on disk.
        min_nodes: --nnodes's MIN (1 without it).
        max_nodes: --nnodes's MAX (1 without it).
        link_timeout: --link-timeout, in seconds.
        rdzv_host: --rdzv-endpoint's host (default 127.0.0.1).
        rdzv_port: --rdzv-endpoint's port; 0: the OS picks one.
        survivors: --survivors.
        last_call: --last-call, in seconds.
        launcher: --launcher's name; None: no launcher.
        launch: The launcher's options: its config file section, --launch flags over it.
        checkpoint_shared: --checkpoint-shared.
        checkpoint_moved: --checkpoint-moved.
        detach: --detach.
        keep: --keep, in seconds.
    """

    nproc: int
    backend: str  # gloo or nccl, resolved
    max_restarts: int
    monitor_interval: float
    timeout: float
    stall_timeout: float | None
    init_process_group: bool
    pool: bool
    preload: tuple[str, ...]
    log_dir: Path
    env: dict[str, str]
    argv: list[str]  # the cell's sys.argv[1:]
    pull: list[str]
    gpus: int
    min_nproc: int
    max_nproc: int
    checkpoint_dir: Path | None
    min_nodes: int
    max_nodes: int
    link_timeout: float
    rdzv_host: str
    rdzv_port: int
    survivors: bool = False  # survivors stay (--survivors)
    last_call: float = 1.0  # --last-call
    launcher: str | None = None
    launch: dict[str, str] = field(default_factory=dict)  # its options, config and flags
    checkpoint_shared: bool = False  # --checkpoint-shared
    checkpoint_moved: bool = False  # --checkpoint-moved
    detach: bool = False  # --detach: the agent in a process of its own
    keep: float = 86400.0  # --keep: an ended detached job's result waits this long

    @property
    def multi_node(self) -> bool:
        """Other machines may join (``elastic-magic join``)."""
        return self.max_nodes > 1

    def check_scale(self, nproc: int) -> None:
        """A resize target must lie within the job's bounds.

        Args:
            nproc: The number of workers asked for on this machine.

        Raises:
            SpecError: ``nproc`` is outside --min-nproc/--max-nproc.
        """
        if not self.min_nproc <= nproc <= self.max_nproc:
            raise SpecError(
                f"scale {nproc}: this job runs between {self.min_nproc} and {self.max_nproc} "
                f"workers; start it with --min-nproc/--max-nproc to allow {nproc}."
            )

    @classmethod
    def create(cls, nproc: int | str | None = None, **options: Any) -> JobSpec:
        """Check every option (see ``OPTIONS``; unset ones take their defaults) and the
        rules between them. Raises SpecError, saying what to change, before anything runs.

        Args:
            nproc: Workers on this machine: N, "auto", "cpu" or "gpu" (default: one per
                GPU, or 1 without GPUs).
            **options: The other options, by ``OPTIONS`` name (``max_restarts=1``).

        Returns:
            The checked JobSpec.

        Raises:
            TypeError: An unknown option (naming the closest one).
            SpecError: A bad value, or options that do not go together.

        Example:
            >>> JobSpec.create(2, max_restarts=1).max_restarts
            1
        """
        _check_names(options, OPTION_NAMES, "job option")
        given = {**options, "nproc": nproc}
        # Each option's own check, in table order; then the rules between options.
        v = {o.name: o.check(o.label, given.get(o.name, o.default)) for o in OPTIONS}
        gpus = v["gpus"]
        count = resolve_nproc(v["nproc"], gpus)
        backend = v["backend"]
        if backend == "auto":
            backend = "nccl" if gpus else "gloo"
        if backend == "nccl":
            if not gpus:
                raise SpecError("--backend nccl needs CUDA GPUs and none is visible; use gloo.")
            if count > gpus:
                raise SpecError(
                    f"--backend nccl runs one worker per GPU: {count} workers but {gpus} GPUs. "
                    f"Use --nproc {gpus}, or --backend gloo."
                )
        low = count if v["min_nproc"] is None else v["min_nproc"]
        high = count if v["max_nproc"] is None else v["max_nproc"]
        if not 1 <= low <= count <= high:
            raise SpecError(
                f"--min-nproc {low} / --max-nproc {high}: need 1 <= min <= nproc ({count}) "
                "<= max."
            )
        if backend == "nccl" and high > gpus:
            raise SpecError(f"--max-nproc {high}: nccl needs a GPU per worker and there are "
                            f"{gpus}. Use --max-nproc {gpus}.")
        if v["preload"] and not v["pool"]:
            raise SpecError("--preload names modules for the warm pool, and --no-pool starts "
                            "every worker without it: drop one of the two.")
        min_nodes, max_nodes = v["nnodes"]
        rdzv_host, rdzv_port = v["rdzv_endpoint"]
        if rdzv_port and max_nodes == 1:
            raise SpecError(f"--rdzv-endpoint {given.get('rdzv_endpoint')}: a fixed port is "
                            "for jobs that other machines join; add --nnodes MIN:MAX.")
        launch = _checked_launcher(v["launcher"], v["launch"], max_nodes)
        if v["checkpoint_dir"] is not None:  # where it may lead depends on the trust given
            v["checkpoint_dir"] = own_dir(v["checkpoint_dir"], "--checkpoint-dir",
                                          trust_path=v["checkpoint_shared"])
        # Options kept as checked, under their own names; then the ones worked out above.
        kept = {name: value for name, value in v.items() if name in cls.__dataclass_fields__}
        return cls(**{**kept, "nproc": count, "backend": backend, "min_nproc": low,
                      "max_nproc": high, "launch": launch},
                   min_nodes=min_nodes, max_nodes=max_nodes,
                   rdzv_host=rdzv_host, rdzv_port=rdzv_port)

    @classmethod
    def for_machine(cls, head: JobSpec, **own: Any) -> JobSpec:
        """The head's job as a joining machine runs it: the per-machine options from
        ``own`` (unset: their defaults, as on this machine), every other option as the
        head has it. Checked again, against this machine's GPUs.

        Args:
            head: The head's JobSpec.
            **own: This machine's per-machine options (nproc, gpus, log_dir...).

        Returns:
            The JobSpec this machine runs.

        Raises:
            TypeError: An option that is not per-machine, or unknown.
            SpecError: A bad value here (more workers than this machine's GPUs, say).
        """
        _check_names(own, (o.name for o in OPTIONS if o.per_machine), "per-machine option")
        followed = {o.name: o.read(head) if o.read else getattr(head, o.name)
                    for o in OPTIONS if not o.per_machine}
        return cls.create(**followed, **own)
