"""JobSpec: everything a launch needs, validated before anything starts.

Every job option is declared once, in ``OPTIONS`` (name, flag, default, help, check, and
whether a joining machine sets it or takes the head's); the %%elastic flags and help,
``launch(**options)`` and the joining machine's spec derive from it.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import shlex
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import logs

BACKENDS = ("auto", "gloo", "nccl")
NPROC_WORDS = ("auto", "cpu", "gpu")

# Bounds that keep every number meaningful where it ends up: torch's timedelta timeouts,
# environment variables, process tables.
MAX_WORKERS = 1024  # on one machine
MAX_RESTARTS = 10_000
MAX_SECONDS = 30 * 24 * 3600.0
MAX_MONITOR_INTERVAL = 60.0


class SpecError(ValueError):
    """A launch option is invalid. The message says what to change."""


def default_log_dir() -> Path:
    """Where logs go without --log-dir: a private folder of this user's, created if need
    be (``logs.py`` says where, and how it is checked and pruned)."""
    try:
        return logs.default_log_dir()
    except logs.NotPrivate as exc:
        raise SpecError(f"--log-dir not given, and {exc}") from None
    except OSError as exc:
        raise SpecError(f"--log-dir not given, and no default log folder can be created "
                        f"({exc}). Give one with --log-dir DIR.") from None


def cuda_device_count() -> int:
    """GPUs visible to workers. The kernel may touch CUDA: workers are fresh interpreters."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_nproc(nproc: int | str | None, gpus: int) -> int:
    """Workers on this machine: a number, or auto/cpu/gpu with torchrun's meaning.

    ``None`` (no flag) means one worker per GPU, or 1 without GPUs.
    """
    if nproc is None:
        return gpus or 1
    if isinstance(nproc, str):
        word = nproc.strip().lower()
        if word == "gpu":
            if not gpus:
                raise SpecError(
                    "--nproc gpu: no CUDA GPU is visible here. Use --nproc N (a number) or cpu."
                )
            return gpus
        if word == "cpu":
            return os.cpu_count() or 1
        if word == "auto":
            return gpus or os.cpu_count() or 1
        try:
            nproc = int(word)
        except ValueError:
            raise SpecError(
                f"--nproc {nproc!r}: expected a whole number or one of {', '.join(NPROC_WORDS)}."
            ) from None
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise SpecError(f"--nproc {nproc!r}: expected a whole number or one of "
                        f"{', '.join(NPROC_WORDS)}.")
    if nproc < 1:
        raise SpecError(f"--nproc {nproc}: a job needs at least 1 worker.")
    if nproc > MAX_WORKERS:
        raise SpecError(f"--nproc {nproc}: at most {MAX_WORKERS} workers on one machine.")
    return nproc


def parse_env(items: list[str] | dict[str, str] | None) -> dict[str, str]:
    """``["K=V", ...]`` (the repeatable --env flag) or a dict, checked."""
    if not items:
        return {}
    pairs = items.items() if isinstance(items, dict) else (_split_env(i) for i in items)
    env: dict[str, str] = {}
    for key, value in pairs:
        if not key or not (key[0].isalpha() or key[0] == "_") or not all(
            c.isalnum() or c == "_" for c in key
        ):
            raise SpecError(f"--env {key}={value}: {key!r} is not a valid variable name.")
        env[key] = str(value)
    return env


def _split_env(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SpecError(f"--env {item!r}: expected KEY=VALUE, for example --env NCCL_DEBUG=INFO.")
    return key.strip(), value


def parse_nnodes(nnodes: int | str | None) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` machines, as torchrun's --nnodes."""
    if nnodes is None:
        return 1, 1
    text = str(nnodes).strip()
    low_text, sep, high_text = text.partition(":")
    try:
        low = int(low_text)
        high = int(high_text) if sep else low
    except ValueError:
        raise SpecError(f"--nnodes {text!r}: expected N or MIN:MAX, for example 1:4.") from None
    if not 1 <= low <= high:
        raise SpecError(f"--nnodes {text}: need 1 <= MIN <= MAX, for example 1:4.")
    return low, high


def parse_endpoint(endpoint: str | None) -> tuple[str, int]:
    """``HOST[:PORT]``: the address other machines reach this one at (the stores listen
    there only). No port, or 0: the OS picks one."""
    if not endpoint:
        return "127.0.0.1", 0
    host, sep, port_text = endpoint.strip().rpartition(":")
    if not sep or not port_text.isdigit():
        host, port_text = endpoint.strip(), "0"
    host = host.strip("[]")
    port = int(port_text)
    if not host or port > 65535:
        raise SpecError(f"--rdzv-endpoint {endpoint!r}: expected HOST or HOST:PORT, for "
                        "example 10.0.0.5:29400 (this machine's address as the others see it).")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))  # the stores will listen there: it must be ours
        except OSError as exc:
            raise SpecError(f"--rdzv-endpoint {endpoint}: cannot listen on {host} "
                            f"({exc.strerror}). Give an address of this machine "
                            "(see `hostname -I`).") from None
    return host, port


# -- checks: (label, value) -> the value to keep; the label is the flag the user sees --------

def _number(label: str, value: Any, kind: type[int] | type[float]) -> Any:
    """A flag's text, or a Python number, as ``kind``."""
    try:
        number = kind(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    kinds = (int,) if kind is int else (int, float)
    if isinstance(number, bool) or not isinstance(number, kinds):
        raise SpecError(f"{label} {value!r}: expected a {'whole ' if kind is int else ''}number.")
    return number


def _zero_or_more(label: str, value: Any, high: int = MAX_RESTARTS) -> int:
    number: int = _number(label, value, int)
    if not 0 <= number <= high:
        raise SpecError(f"{label} {value}: must be between 0 and {high}.")
    return number


def _seconds(label: str, value: Any, high: float = MAX_SECONDS, above: float = 0) -> float:
    number = float(_number(label, value, float))
    if not (math.isfinite(number) and above < number <= high):  # nan fails every comparison
        raise SpecError(f"{label} {value}: must be above {above:g} and at most {high:g} "
                        "seconds.")
    return number


def _interval(label: str, value: Any) -> float:
    return _seconds(label, value, MAX_MONITOR_INTERVAL)


def _optional_count(label: str, value: Any) -> int | None:
    if value is None:
        return None
    number = int(_number(label, value, int))
    if not 1 <= number <= MAX_WORKERS:
        raise SpecError(f"{label} {value}: must be between 1 and {MAX_WORKERS} workers.")
    return number


def _gpus(label: str, value: Any) -> int:
    return cuda_device_count() if value is None else _zero_or_more(label, value)


def _backend(label: str, value: Any) -> str:
    backend = str(value or "auto").lower()
    if backend not in BACKENDS:
        raise SpecError(f"{label} {backend!r}: choose one of {', '.join(BACKENDS)}.")
    return backend


def _argv(label: str, value: Any) -> list[str]:
    """A list, or one string split as a shell would (the flag's form: "--lr 0.1")."""
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise SpecError(f"{label} {value!r}: {exc}; quote it as one string.") from None
    return [str(word) for word in value or ()]


def _pull(label: str, value: Any) -> list[str]:
    """Variable names: a list, or one string separated by commas or spaces."""
    names = value.replace(",", " ").split() if isinstance(value, str) else list(value or ())
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecError(f"{label} {name!r}: not a Python variable name.")
    return names


def _usable_dir(folder: str | os.PathLike[str], flag: str) -> Path:
    path = Path(folder).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(
            f"{flag} {path}: cannot create it ({exc.strerror}). Pick a writable folder."
        ) from None
    if not os.access(path, os.W_OK):
        raise SpecError(f"{flag} {path}: not writable. Pick a writable folder.")
    return path


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
        if self.action != "store_false":
            kwargs["metavar"] = self.metavar
        return (self.flag or "",), kwargs


OPTIONS: tuple[Option, ...] = (
    Option("nproc", "--nproc", None, "workers on this machine: N, auto, cpu or gpu "
           "(default: one per GPU, or 1 without GPUs)", "N|auto|cpu|gpu", per_machine=True),
    Option("min_nproc", "--min-nproc", None, "fewest workers a resize may leave (default: "
           "--nproc)", "N", _optional_count, per_machine=True),
    Option("max_nproc", "--max-nproc", None, "most workers a resize may start (default: "
           "--nproc)", "N", _optional_count, per_machine=True),
    Option("backend", "--backend", "auto", "process-group backend: auto (nccl with CUDA, "
           "else gloo), gloo or nccl", "auto|gloo|nccl", _backend),
    Option("init_process_group", "--no-init", True, "never make the process group for the "
           "cell (by default it is made when the cell first uses it, unless the cell calls "
           "init_process_group itself)", action="store_false", check=lambda _, v: bool(v)),
    Option("timeout", "--timeout", 300.0, "seconds workers wait for each other: rendezvous "
           "and collectives", "S", _seconds),
    Option("stall_timeout", "--stall-timeout", None, "a rank without progress for S seconds "
           "outside any collective has stalled: the job fails, naming it (default off)", "S",
           lambda flag, v: None if v is None else _seconds(flag, v, above=2)),
    Option("max_restarts", "--max-restarts", 0, "restarts of the whole group after a "
           "failure", "N", _zero_or_more),
    Option("monitor_interval", "--monitor-interval", 0.1, "seconds between health checks "
           "of the workers", "S", _interval),
    Option("env", "--env", None, "set an environment variable in the workers (repeatable)",
           "K=V", lambda _, v: parse_env(v), action="append"),
    Option("argv", "--args", None, "the cell's sys.argv[1:], as one string: \"--lr 0.1\"",
           "ARGS", _argv),
    Option("pull", "--pull", None, "after success, copy these variables (comma-separated) "
           "from rank 0", "NAMES", _pull),
    Option("nnodes", "--nnodes", None, "machines in the job, as torchrun's --nnodes (default "
           "1). Others join with the `elastic-magic join` command the cell prints",
           "N|MIN:MAX", lambda _, v: parse_nnodes(v),
           read=lambda spec: f"{spec.min_nodes}:{spec.max_nodes}"),
    Option("rdzv_endpoint", "--rdzv-endpoint", None, "with --nnodes: this machine's address "
           "as the others reach it (the rendezvous listens there only; default 127.0.0.1, a "
           "port the OS picks)", "HOST[:PORT]", lambda _, v: parse_endpoint(v),
           per_machine=True),
    Option("log_dir", "--log-dir", None, "where full per-rank logs go (default: "
           "~/.cache/elastic_magic/logs, private to you and pruned as jobs start: the newest "
           f"{logs.KEEP_RUNS} runs of the last {logs.KEEP_DAYS:g} days are kept; a folder you "
           "give is never pruned)", "DIR",
           lambda flag, v: _usable_dir(v, flag) if v else default_log_dir(), per_machine=True),
    Option("checkpoint_dir", "--checkpoint-dir", None, "also keep the last committed elastic "
           "State here (atomic writes); a job started with a checkpoint in it resumes from "
           "it", "DIR", lambda flag, v: _usable_dir(v, flag) if v else None, per_machine=True),
    # Detected where the workers run; Python callers (tests) may state it.
    Option("gpus", None, None, "CUDA GPUs the workers may use (default: those visible)",
           check=_gpus, per_machine=True),
)
OPTION_NAMES = tuple(option.name for option in OPTIONS)


def flag_arguments() -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """``add_argument`` arguments for every option that has a flag, in table order."""
    return [option.argument() for option in OPTIONS if option.flag]


def options_help() -> str:
    """One line per option, for docstrings of the Python API."""
    return "\n".join(f"    {o.name} ({o.flag or 'Python only'}): {o.help_text}" for o in OPTIONS)


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
    the options it takes are declared in ``OPTIONS``."""

    nproc: int
    backend: str  # gloo or nccl, resolved
    max_restarts: int
    monitor_interval: float
    timeout: float
    stall_timeout: float | None
    init_process_group: bool
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
    rdzv_host: str
    rdzv_port: int

    @property
    def multi_node(self) -> bool:
        """Other machines may join (``elastic-magic join``)."""
        return self.max_nodes > 1

    def check_scale(self, nproc: int) -> None:
        """A resize target must lie within the job's bounds."""
        if not self.min_nproc <= nproc <= self.max_nproc:
            raise SpecError(
                f"scale {nproc}: this job runs between {self.min_nproc} and {self.max_nproc} "
                f"workers; start it with --min-nproc/--max-nproc to allow {nproc}."
            )

    @classmethod
    def create(cls, nproc: int | str | None = None, **options: Any) -> JobSpec:
        """Check every option (see ``OPTIONS``; unset ones take their defaults) and the
        rules between them. Raises SpecError, saying what to change, before anything runs."""
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
        min_nodes, max_nodes = v["nnodes"]
        rdzv_host, rdzv_port = v["rdzv_endpoint"]
        if rdzv_port and max_nodes == 1:
            raise SpecError(f"--rdzv-endpoint {given.get('rdzv_endpoint')}: a fixed port is "
                            "for jobs that other machines join; add --nnodes MIN:MAX.")
        # Options kept as checked, under their own names; then the ones worked out above.
        kept = {name: value for name, value in v.items() if name in cls.__dataclass_fields__}
        return cls(**{**kept, "nproc": count, "backend": backend, "min_nproc": low,
                      "max_nproc": high}, min_nodes=min_nodes, max_nodes=max_nodes,
                   rdzv_host=rdzv_host, rdzv_port=rdzv_port)

    @classmethod
    def for_machine(cls, head: JobSpec, **own: Any) -> JobSpec:
        """The head's job as a joining machine runs it: the per-machine options from
        ``own`` (unset: their defaults, as on this machine), every other option as the
        head has it. Checked again, against this machine's GPUs."""
        _check_names(own, (o.name for o in OPTIONS if o.per_machine), "per-machine option")
        followed = {o.name: o.read(head) if o.read else getattr(head, o.name)
                    for o in OPTIONS if not o.per_machine}
        return cls.create(**followed, **own)
