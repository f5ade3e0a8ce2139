"""JobSpec: everything a launch needs, validated before anything starts."""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

BACKENDS = ("auto", "gloo", "nccl")
NPROC_WORDS = ("auto", "cpu", "gpu")


class SpecError(ValueError):
    """A launch option is invalid. The message says what to change."""


def default_log_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"elastic_magic-{os.getuid()}" / "logs"


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
    if nproc < 1:
        raise SpecError(f"--nproc {nproc}: a job needs at least 1 worker.")
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


@dataclass
class JobSpec:
    """A validated launch request. Build it with :meth:`create`."""

    nproc: int
    backend: str
    max_restarts: int = 0
    monitor_interval: float = 0.1
    timeout: float = 300.0
    init_process_group: bool = True
    log_dir: Path = field(default_factory=default_log_dir)
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    pull: list[str] = field(default_factory=list)
    gpus: int = 0
    min_nproc: int = 1
    max_nproc: int = 1
    checkpoint_dir: Path | None = None
    min_nodes: int = 1
    max_nodes: int = 1
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int = 0

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
    def create(
        cls,
        nproc: int | str | None = None,
        *,
        backend: str = "auto",
        max_restarts: int = 0,
        monitor_interval: float = 0.1,
        timeout: float = 300.0,
        init_process_group: bool = True,
        log_dir: str | os.PathLike[str] | None = None,
        env: list[str] | dict[str, str] | None = None,
        args: list[str] | None = None,
        pull: list[str] | None = None,
        gpus: int | None = None,
        min_nproc: int | None = None,
        max_nproc: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        nnodes: int | str | None = None,
        rdzv_endpoint: str | None = None,
    ) -> JobSpec:
        gpus = cuda_device_count() if gpus is None else gpus
        count = resolve_nproc(nproc, gpus)
        backend = (backend or "auto").lower()
        if backend not in BACKENDS:
            raise SpecError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}.")
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
        if max_restarts < 0:
            raise SpecError(f"--max-restarts {max_restarts}: must be 0 or more.")
        if not monitor_interval > 0:
            raise SpecError(f"--monitor-interval {monitor_interval}: must be above 0 seconds.")
        if not timeout > 0:
            raise SpecError(f"--timeout {timeout}: must be above 0 seconds.")
        low = count if min_nproc is None else min_nproc
        high = count if max_nproc is None else max_nproc
        if not 1 <= low <= count <= high:
            raise SpecError(
                f"--min-nproc {low} / --max-nproc {high}: need 1 <= min <= nproc ({count}) "
                "<= max."
            )
        if backend == "nccl" and high > gpus:
            raise SpecError(f"--max-nproc {high}: nccl needs a GPU per worker and there are "
                            f"{gpus}. Use --max-nproc {gpus}.")
        min_nodes, max_nodes = parse_nnodes(nnodes)
        rdzv_host, rdzv_port = parse_endpoint(rdzv_endpoint)
        if rdzv_port and max_nodes == 1:
            raise SpecError(f"--rdzv-endpoint {rdzv_endpoint}: a fixed port is for jobs that "
                            "other machines join; add --nnodes MIN:MAX.")
        for name in pull or []:
            if not name.isidentifier():
                raise SpecError(f"--pull {name!r}: not a Python variable name.")
        return cls(
            nproc=count,
            backend=backend,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            timeout=timeout,
            init_process_group=init_process_group,
            log_dir=_usable_dir(log_dir or default_log_dir(), "--log-dir"),
            env=parse_env(env),
            args=list(args or []),
            pull=list(pull or []),
            gpus=gpus,
            min_nproc=low,
            max_nproc=high,
            checkpoint_dir=_usable_dir(checkpoint_dir, "--checkpoint-dir")
            if checkpoint_dir else None,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            rdzv_host=rdzv_host,
            rdzv_port=rdzv_port,
        )


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
