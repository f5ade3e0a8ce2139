"""A rank that leaves its group stops waiting on the group's store.

Forming a process group (the default one where the cell first uses it, a subgroup, a
device mesh) waits in the store for every peer's address. A peer that died before writing
it never will, and a wait in the store, in torch's C++, neither errors nor returns on the
agent's word (a signal): the survivor would sit there until the store's timeout. Each
group has a store of its own (the agent hosts a fresh one every round), so a rank told to
leave its group shuts its connections to that store: the wait errors, the agent's word is
raised as the error reaches Python, and the rank parks.
"""

from __future__ import annotations

import contextlib
import os
import socket


def leave_store() -> int:
    """Shut this process's connections to its group's store (``MASTER_ADDR``:
    ``MASTER_PORT``); how many there were."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return 0
    try:
        addresses = {_plain(str(info[4][0])) for info in socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM)}
    except OSError:
        return 0
    cut = 0
    for fd in _socket_fds():
        try:
            copy = os.dup(fd)
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:  # its number reused meanwhile, by something else than a socket
            os.close(copy)
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                    or sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()
            except OSError:  # a listening socket, or not connected
                continue
            if peer[1] == int(port) and _plain(peer[0]) in addresses:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # the socket's, not only this copy's
                    cut += 1
    return cut


def _socket_fds() -> list[int]:
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    found.append(int(name))
    return found


def _plain(address: str) -> str:
    """An IPv4 address as itself, whether or not it came as IPv6's mapped form."""
    return address.removeprefix("::ffff:")
