"""What this kernel's zygotes import beyond torch and the worker runtime: what cells import is
what the pool should preload.

The list is this process's, for every zygote it starts: the defaults (DDP's path and data
loading), the modules jobs name (``--preload``), and those the workers of earlier cells
imported (``Imported`` reports; ``worker/imports.py`` says which are ever reported). A
module the zygote had to leave out (it initialised CUDA or started a thread when imported,
it failed to import, or it is not where the workers found it) is remembered with why, and
never asked for again.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable
from pathlib import Path

# What a typical cell needs and the base zygote lacks: DistributedDataParallel's first
# construction imports torch._dynamo (1.3 s here, 4.7 s on an H200 machine; it neither
# initialises CUDA nor starts a thread); a DataLoader with workers, the rest.
DEFAULT = (
    "torch._dynamo",
    "torch.utils.data",
    "torch.utils.data._utils.worker",
    "multiprocessing.popen_fork",
    "multiprocessing.queues",
    "multiprocessing.synchronize",
    "elastic_magic.training.data",
)
MAX_MODULES = 5000  # a notebook's cells import a few hundred packages' modules at most
_PART = 100  # entries per message: a SOCK_SEQPACKET message must fit the socket's buffer

Entry = tuple[str, str | None]  # module name, and the file the workers imported (if known)


class PreloadList:
    """This kernel's preload list and the modules left out of it. Not thread-safe: the
    pool holds its lock."""

    def __init__(self) -> None:
        self._wanted: dict[str, str | None] = dict.fromkeys(DEFAULT)  # in import order
        self.named: set[str] = set()  # by --preload
        self.left_out: dict[str, str] = {}  # module -> why

    def add(self, entries: Iterable[Entry], *, named: bool = False) -> bool:
        """Add modules not listed yet; True when the list grew."""
        grew = False
        for name, origin in entries:
            if named:
                self.named.add(name)
            if name not in self._wanted and not self._is_left_out(name) \
                    and len(self._wanted) < MAX_MODULES:
                self._wanted[name] = origin
                grew = True
        return grew

    def drop_implied(self, names: Iterable[str]) -> None:
        """Unlist learned modules a zygote imported with an earlier one (most of a big
        package's): the list stays short and still yields the same zygote. Should that
        stop being so, a worker reports the module again."""
        for name in names:
            if name not in DEFAULT and name not in self.named:
                self._wanted.pop(name, None)

    def leave_out(self, name: str, why: str) -> None:
        self.left_out.setdefault(name, why)

    def _is_left_out(self, name: str) -> bool:
        """``name`` or a package above it (importing it imports them) is left out."""
        parts = name.split(".")
        return any(".".join(parts[:depth]) in self.left_out for depth in range(1, len(parts) + 1))

    def modules(self) -> tuple[Entry, ...]:
        """What a new zygote imports, in order."""
        return tuple((n, o) for n, o in self._wanted.items() if not self._is_left_out(n))

    def covered_by(self, built: Iterable[Entry]) -> bool:
        """A zygote built with ``built`` has every module of the list."""
        return {n for n, _ in self.modules()} <= {n for n, _ in built}

    def describe(self) -> list[str]:
        """Lines for ``%elastic status``: the list's size and what was left out, why."""
        wanted = self.modules()
        learned = len(wanted) - len([n for n, _ in wanted if n in DEFAULT or n in self.named])
        lines = [f"preloads {len(wanted)} modules beyond torch ({len(DEFAULT)} by default, "
                 f"{len(self.named)} named with --preload, {learned} learned from cells)"]
        lines += [f"left out {name}: {why}" for name, why in self.left_out.items()]
        return lines


def send_list(sock: socket.socket, modules: tuple[Entry, ...], sys_path: Iterable[str],
              spares: int = 0) -> None:
    """Send a new zygote its preload list, in parts, with the site-packages folders of the
    kernel's path (where a learned module may live; the zygote trusts nothing else), and
    the spare ranks to keep (``worker/spares.py``)."""
    path = [p for p in sys_path if Path(p).name in ("site-packages", "dist-packages")]
    parts = [modules[i:i + _PART] for i in range(0, len(modules), _PART)] or [()]
    for i, part in enumerate(parts):
        message = {"op": "preload", "modules": [list(e) for e in part], "path": path,
                   "more": i < len(parts) - 1, "spares": spares}
        sock.sendall(json.dumps(message).encode())
