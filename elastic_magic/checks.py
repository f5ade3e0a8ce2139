"""How each job option's value is read and checked: flag text or Python values alike,
bounded so that every number means something where it ends up. ``spec.OPTIONS`` names one
of these for each option."""

from __future__ import annotations

import math
import os
import shlex
import socket
from pathlib import Path
from typing import Any

from . import folders, logs

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
    if host in ("0.0.0.0", "::"):  # it would reach the others as their own MASTER_ADDR
        raise SpecError(f"--rdzv-endpoint {endpoint}: {host} is every interface, not an "
                        "address the other machines can reach; give this machine's address "
                        "on their network (see `hostname -I`), for example 10.0.0.5:29400.")
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

def as_number(label: str, value: Any, kind: type[int] | type[float]) -> Any:
    """A flag's text, or a Python number, as ``kind``."""
    try:
        number = kind(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    kinds = (int,) if kind is int else (int, float)
    if isinstance(number, bool) or not isinstance(number, kinds):
        raise SpecError(f"{label} {value!r}: expected a {'whole ' if kind is int else ''}number.")
    return number


def zero_or_more(label: str, value: Any, high: int = MAX_RESTARTS) -> int:
    number: int = as_number(label, value, int)
    if not 0 <= number <= high:
        raise SpecError(f"{label} {value}: must be between 0 and {high}.")
    return number


def seconds(label: str, value: Any, high: float = MAX_SECONDS, above: float = 0) -> float:
    number = float(as_number(label, value, float))
    if not (math.isfinite(number) and above < number <= high):  # nan fails every comparison
        raise SpecError(f"{label} {value}: must be above {above:g} and at most {high:g} "
                        "seconds.")
    return number


def interval(label: str, value: Any) -> float:
    return seconds(label, value, MAX_MONITOR_INTERVAL)


def optional_count(label: str, value: Any) -> int | None:
    if value is None:
        return None
    number = int(as_number(label, value, int))
    if not 1 <= number <= MAX_WORKERS:
        raise SpecError(f"{label} {value}: must be between 1 and {MAX_WORKERS} workers.")
    return number


def gpu_count(label: str, value: Any) -> int:
    return cuda_device_count() if value is None else zero_or_more(label, value)


def backend_name(label: str, value: Any) -> str:
    backend = str(value or "auto").lower()
    if backend not in BACKENDS:
        raise SpecError(f"{label} {backend!r}: choose one of {', '.join(BACKENDS)}.")
    return backend


def argv_words(label: str, value: Any) -> list[str]:
    """A list, or one string split as a shell would (the flag's form: "--lr 0.1")."""
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise SpecError(f"{label} {value!r}: {exc}; quote it as one string.") from None
    return [str(word) for word in value or ()]


def variable_names(label: str, value: Any) -> list[str]:
    """Variable names: a list, or one string separated by commas or spaces."""
    names = value.replace(",", " ").split() if isinstance(value, str) else list(value or ())
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecError(f"{label} {name!r}: not a Python variable name.")
    return names


def module_names(label: str, value: Any) -> tuple[str, ...]:
    """Dotted module names: a list, or one string separated by commas."""
    names = value.split(",") if isinstance(value, str) else list(value or ())
    names = [n.strip() if isinstance(n, str) else n for n in names]
    for name in names:
        if not isinstance(name, str) or not all(p.isidentifier() for p in name.split(".")):
            raise SpecError(f"{label} {name!r}: not a module name; give dotted names "
                            "separated by commas, for example `--preload transformers,"
                            "lightning.pytorch`.")
    return tuple(dict.fromkeys(names))


def usable_dir(folder: str | os.PathLike[str], flag: str) -> Path:
    """A folder to write into; the missing part of it created 0700."""
    path = Path(folder).expanduser().resolve()
    try:
        folders.make_folders(path)
    except OSError as exc:
        raise SpecError(
            f"{flag} {path}: cannot create it ({exc.strerror}). Pick a writable folder."
        ) from None
    if not path.is_dir():
        raise SpecError(f"{flag} {path}: not a folder. Pick a folder.")
    if not os.access(path, os.W_OK):
        raise SpecError(f"{flag} {path}: not writable. Pick a writable folder.")
    return path


TRUST_PATH = "--checkpoint-shared (checkpoint_shared=True in Python)"


def own_dir(folder: str | os.PathLike[str], flag: str, *, trust_path: bool = False) -> Path:
    """A folder whose files a job reads back and unpickles (--checkpoint-dir), where it
    really is: reached through folders no one else can write (unless ``trust_path``) and
    no link someone else could have made, the missing part created 0700; the user's, and
    no one else may write to it (the agent checks it all again, on descriptors)."""
    given = folders.absolute(Path(folder))
    try:
        fd, path = folders.open_path(given, create=True, trust_writers=trust_path)
    except folders.SharedFolder as exc:
        raise SpecError(
            f"{flag} {given}: {exc}, and a job would resume from that folder's checkpoint "
            f"and write over it. Give a folder below folders that only you (or root) can "
            f"write, or add {TRUST_PATH} if you trust everyone who can write there.") from None
    except folders.NotPrivate as exc:
        raise SpecError(f"{flag} {given}: {exc}. Give the folder's own path (a link of "
                        "yours, in a folder only you can write, is followed).") from None
    except OSError as exc:
        raise SpecError(f"{flag} {given}: cannot create or open it ({exc.strerror}). Pick "
                        "a folder of yours.") from None
    try:
        problem = folders.describe(os.fstat(fd), path, private=False)
    finally:
        os.close(fd)
    if problem:
        raise SpecError(
            f"{flag} {problem}. A checkpoint planted there would run its code in your job "
            f"when it resumes: give a folder that only you can write (if this one is yours: "
            f"chmod go-w {path}).")
    if not os.access(path, os.W_OK):
        raise SpecError(f"{flag} {path}: not writable. Pick a writable folder.")
    return path
