"""What a module the zygote preloads must not do when imported, since no forked worker
could undo it: initialise CUDA, start a thread, leave a file open (``_become_worker``
closes every descriptor the zygote had, and the cell's next ``open()`` reuses the number),
or read a variable that differs per rank (the zygote has none of them: a module that keeps
its answer, such as lightning's ``rank_zero_only.rank``, would be wrong in every rank).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, MutableMapping

from . import rank_answers

# Variables a round gives each rank (environment/torchrun_env): they differ between workers
# of one zygote, so the zygote is started without them and no module it imports may
# read them.
PER_ROUND = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_DIST_INIT_BARRIER",
    # per worker or per machine, read only once the worker runs (torch reads the devices
    # at CUDA's first use, gloo and NCCL the interface when the group is made)
    "ELASTIC_MAGIC_SLOT", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
})


def is_per_round(key: str) -> bool:
    return key in PER_ROUND or key.startswith("TORCHELASTIC_")


class _Recording(MutableMapping[str, str]):
    """``os.environ`` while a module is imported: the same variables, and a note of each
    per-round one asked for (present or not). A module that keeps this object (``from os
    import environ``) still sees the real environment later."""

    def __init__(self, real: MutableMapping[str, str]) -> None:
        self.real = real
        self.reads: set[tuple[str, str]] | None = set()  # (module, variable); None: done

    def __getitem__(self, key: str) -> str:
        if self.reads is not None and is_per_round(key):
            self.reads.add((_reader(), key))
        return self.real[key]

    def __setitem__(self, key: str, value: str) -> None:
        self.real[key] = value

    def __delitem__(self, key: str) -> None:
        del self.real[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.real)

    def __len__(self) -> int:
        return len(self.real)

    def copy(self) -> dict[str, str]:
        return dict(self)

    def __repr__(self) -> str:
        return repr(self.real)


def _reader() -> str:
    """The module being imported that reads the environment: the nearest module body on the
    stack (``os.environ.get``, ``os.getenv`` and a function the module calls read for it)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_name != "<module>":
        frame = frame.f_back
    return str(frame.f_globals.get("__name__", "?"))


def _open_fds() -> set[int]:
    listed = {int(name) for name in os.listdir("/proc/self/fd")}
    return {fd for fd in listed if _is_open(fd)}  # not the listing's own, closed now


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@contextlib.contextmanager
def watched() -> Iterator[list[str]]:
    """Run an import inside: the list yielded then holds why the zygote is no longer safe
    to fork, if it is not (empty when it is)."""
    import torch  # the zygote has it; the kernel's side needs only PER_ROUND

    threads, fds = _threads(), _open_fds()
    real = os.environ
    recording = _Recording(real)
    # Swapped, not cleared (B003): os.getenv reads os.environ too.
    os.environ = recording  # type: ignore[assignment]  # noqa: B003
    found: list[str] = []
    try:
        yield found
    finally:
        os.environ = real  # noqa: B003
        reads, recording.reads = recording.reads or set(), None
        if torch.cuda.is_initialized():
            found.append("initialises CUDA when imported")
        if (started := _threads() - threads) > 0:
            found.append(f"starts {started} thread(s) when imported "
                         "(forking a process with threads is unsafe)")
        if left := sorted(_open_fds() - fds):
            files = ", ".join(_describe(fd) for fd in left)
            found.append(f"leaves {len(left)} file(s) open when imported ({files}); a "
                         "pooled worker has none of the pool's files, and a file the "
                         "cell opens would take its place")
        reads = {(module, key) for module, key in reads
                 if not rank_answers.excused(module, key)}
        if reads:
            keys = sorted({key for _, key in reads})
            modules = sorted({module for module, _ in reads})
            found.append(f"reads {', '.join(keys)} when imported (in {', '.join(modules)}; "
                         "the pool has no rank: every rank would keep the pool's answer)")


def _describe(fd: int) -> str:
    with contextlib.suppress(OSError):
        return f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"
    return str(fd)
