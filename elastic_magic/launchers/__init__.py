"""Launchers: the notebook starts and cancels the machines of its job on a cluster.

A job with ``--nnodes MIN:MAX --launcher NAME`` asks a scheduler (Slurm, SSH to a list of
hosts; others by entry point) for machines that run ``elastic-magic join`` for it. A launcher
is small: start one machine's join, list its allocations with the scheduler's own reason
for those that wait, cancel one, cancel all, and name what a watchdog must run (and the
files it must remove) if the kernel dies before it could cancel them. Everything else (how
many, when, giving machines back, the watchdog) is the
:class:`~elastic_magic.launchers.cluster.Cluster`'s, the same for every scheduler.

Another scheduler is a class with this interface, registered under the
``elastic_magic.launchers`` entry-point group of its distribution::

    [project.entry-points."elastic_magic.launchers"]
    pbs = "my_package.pbs:PbsLauncher"

Options come from the config file (``$ELASTIC_MAGIC_LAUNCHERS``, else
``$XDG_CONFIG_HOME/elastic_magic/launchers.ini``, else ``~/.config/...``; one section per
launcher, ``key = value`` lines) and from ``--launch KEY=VALUE`` flags, which win.
"""

from __future__ import annotations

import configparser
import errno
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import ClassVar, Protocol

from ..checks import SpecError
from ..folders import READ_FILE, describe

ENTRY_POINT_GROUP = "elastic_magic.launchers"
CONFIG_VARIABLE = "ELASTIC_MAGIC_LAUNCHERS"
# Shipped here: found without the package's metadata (a source checkout on PYTHONPATH).
BUILT_IN = {"local": "elastic_magic.launchers.local:LocalLauncher",
            "slurm": "elastic_magic.launchers.slurm:SlurmLauncher",
            "ssh": "elastic_magic.launchers.ssh:SshLauncher"}


class LauncherError(RuntimeError):
    """The scheduler refused or failed; the message says what it answered."""


@dataclass(frozen=True)
class JoinRequest:
    """What a machine needs to join: the head's endpoint and the job's token (which a
    launcher must never put on a command line: a 0600 file, stdin or the environment).

    Attributes:
        endpoint: The head's ``HOST:PORT``, as ``elastic-magic join`` takes it.
        token: The job's secret (``--token-file`` or ``--token-stdin`` of the join).
        run_id: The job's name (for job names and file names).
        nproc: Each machine's --nproc; None: its own default.
    """

    endpoint: str
    token: str
    run_id: str
    nproc: str | None = None


@dataclass(frozen=True)
class Allocation:
    """One machine asked of the scheduler.

    Attributes:
        id: The scheduler's name for it (a Slurm job ID, ``host#n``).
        state: "pending", "running" or "ended".
        reason: Why it waits (or ended), in the scheduler's words (squeue's Reason).
        where: The machine it runs on, once known.
    """

    id: str
    state: str
    reason: str = ""
    where: str = ""

    def describe(self) -> str:
        """One line for the job's status.

        Returns:
            "1234: pending (Priority)", "5678: running on node3", say.
        """
        why = f" ({self.reason})" if self.reason and self.state == "pending" else ""
        where = f" on {self.where}" if self.where else ""
        return f"{self.id}: {self.state}{why}{where}"


class Launcher(Protocol):
    """The interface every launcher has (see the module's docstring). It is made once to
    check the options (when the job's options are), then again for the job.

    Args:
        options: The launcher's section of the config file and the ``--launch KEY=VALUE``
            flags over it (``-`` in keys read as ``_``).

    Attributes:
        name: The name it is registered under (``--launcher NAME``).

    Raises:
        SpecError: An unknown option (``known_options`` says which exist) or a bad value.

    Example:
        Registered in its distribution's ``pyproject.toml``::

            [project.entry-points."elastic_magic.launchers"]
            pbs = "my_package.pbs:PbsLauncher"
    """

    name: ClassVar[str]

    def __init__(self, options: Mapping[str, str]) -> None:
        """Check the options (raise SpecError naming the bad one); start nothing."""

    def start(self, request: JoinRequest) -> Allocation:
        """Ask for one machine running ``elastic-magic join`` for this job.

        Args:
            request: Where it joins, and the token (never on a command line).

        Returns:
            The new allocation (pending, often).

        Raises:
            LauncherError: The scheduler refused; one is asked for again after a delay.
        """

    def allocations(self) -> list[Allocation]:
        """Every allocation started and not yet cancelled, as the scheduler sees it.

        Returns:
            Each one's state, and why it waits; one that ended unasked is replaced.

        Raises:
            LauncherError: The scheduler cannot be asked (the job's status says so).
        """

    def cancel(self, allocation_id: str) -> None:
        """End one allocation (its join leaves the job as a machine that is stopped).

        Args:
            allocation_id: An ``Allocation.id`` that ``start`` returned (one already ended
                or cancelled: nothing to do).

        Raises:
            LauncherError: The scheduler has not confirmed the cancel.
        """

    def cancel_all(self) -> None:
        """End every allocation this launcher started, and remove the files of
        ``orphan_files``.

        Raises:
            LauncherError: The scheduler has not confirmed every cancel.
        """

    def orphan_cleanup(self, allocation_id: str) -> list[list[str]]:
        """The commands a watchdog runs for this allocation if the kernel dies first (none
        where the allocation ends by itself when the kernel is gone).

        Args:
            allocation_id: An ``Allocation.id`` that ``start`` returned.

        Returns:
            Each command's argv: ``[["scancel", "1234"]]``, or ``[]``.
        """

    def orphan_files(self) -> list[str]:
        """The files of the job's that ``start`` made (a token file), which a watchdog
        removes if the kernel dies first, whatever became of the allocations.

        A launcher whose ``start`` submits a job that a kernel killed or interrupted
        meanwhile could leave behind also has ``prepare_start(request) -> (key, commands)``:
        the commands that cancel what the next ``start`` submits, whatever becomes of it (a
        unique job name's ``scancel``), held by the watchdog before ``start`` runs; the
        files that ``start`` will write are in ``orphan_files`` by then too.

        Returns:
            The files' paths (``[]`` where ``start`` writes none).
        """


def _registry() -> dict[str, str]:
    found = dict(BUILT_IN)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry.value)
    return found


def launcher_names() -> list[str]:
    return sorted(_registry())


def launcher_class(name: str) -> type[Launcher]:
    registry = _registry()
    if name not in registry:
        raise SpecError(f"--launcher {name}: no such launcher; the launchers are "
                        f"{', '.join(sorted(registry))} (others register under the "
                        f"{ENTRY_POINT_GROUP!r} entry-point group).")
    module, _, attribute = registry[name].partition(":")
    cls: type[Launcher] = getattr(importlib.import_module(module), attribute)
    return cls


def config_path() -> Path:
    if os.environ.get(CONFIG_VARIABLE):
        path = Path(os.environ[CONFIG_VARIABLE])
        if not path.is_absolute():  # relative: to whatever folder the notebook runs in
            raise SpecError(f"${CONFIG_VARIABLE}={path}: name the launcher config by its "
                            f"absolute path (e.g. {Path.home() / path}).")
        return path
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".config"
    return root / "elastic_magic" / "launchers.ini"


def configured_options(name: str, path: Path | None = None) -> dict[str, str]:
    """The launcher's section of the config file (none: empty). Its ssh, python and hosts
    decide which program or machine gets the job's token: a file another user owns or may
    write is refused, and so is a link (checked on the descriptor that is read)."""
    path = path or config_path()
    parser = configparser.ConfigParser(interpolation=None)
    try:
        fd = os.open(path, READ_FILE)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SpecError(f"the launcher config {path} is a symbolic link: put the file "
                            "itself there (it says who gets the job's token).") from None
        raise SpecError(f"the launcher config {path} cannot be read: {exc}") from None
    with os.fdopen(fd) as file:
        problem = describe(os.fstat(fd), path, private=False)
        if problem:
            raise SpecError(f"the launcher config {problem}; it says which program and "
                            "machines get the job's token, so it must be yours and writable "
                            f"by you alone (chown, then chmod go-w {path}).")
        try:
            parser.read_file(file)
        except (OSError, UnicodeDecodeError, configparser.Error) as exc:
            raise SpecError(f"the launcher config {path} cannot be read: {exc}") from None
    if not parser.has_section(name):
        return {}
    return {key.replace("-", "_"): value for key, value in parser.items(name)}


def parse_launch(items: list[str] | Mapping[str, str] | None) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` (the repeatable --launch flag) or a mapping, checked."""
    if not items:
        return {}
    if isinstance(items, Mapping):
        return {str(k): str(v) for k, v in items.items()}
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--launch {item}: write KEY=VALUE (hosts=a,b or partition=gpu).")
        options[key.strip().replace("-", "_")] = value.strip()
    return options


def launcher_options(name: str, flags: Mapping[str, str]) -> dict[str, str]:
    """The config file's options for ``name``, the flags over them, checked by the
    launcher itself (a SpecError names what is wrong, before anything starts)."""
    options = {**configured_options(name), **flags}
    launcher_class(name)(options)
    return options


def make_launcher(name: str, options: Mapping[str, str]) -> Launcher:
    return launcher_class(name)(options)


def known_options(name: str, options: Mapping[str, str], allowed: Mapping[str, str]) -> None:
    """Unknown option names are refused, listing the ones that exist."""
    for key in options:
        if key not in allowed:
            listed = "; ".join(f"{k}: {v}" for k, v in allowed.items())
            raise SpecError(f"--launcher {name}: no option {key!r}. Its options: {listed}.")
