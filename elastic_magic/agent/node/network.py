"""Which network interface this machine's workers talk to the other machines through, and
to each other.

gloo (and NCCL's bootstrap) pick their own address from the machine's hostname unless
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name an interface. On a stock Debian or Ubuntu
machine the hostname resolves to 127.0.1.1, so each rank would offer the other machines a
loopback address they cannot reach ("Gloo connectFullMesh failed ... Connection refused,
remote=[127.0.1.1]"). Every agent of a multi-node job knows the address by which the others
reach it (the head: its ``--rdzv-endpoint``; a joined machine: its end of the link to the
head), so it names the interface that carries that address for its own workers. The
interface is chosen per machine, never forwarded: machines name their interfaces differently.
A standalone job, and machines that all reach each other on loopback, name the loopback
interface: where the hostname resolves to the machine's own address (as on many servers),
gloo would otherwise listen there, where other machines reach it.
The user's own setting (``--env``, or the kernel's or agent's environment) wins.
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import os
import socket
from collections.abc import Mapping

from ...wire.events import NetworkChosen

# Set for the workers, each unless the user set it; both name the interface to use.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK = "127.0.0.1"


def choose(address: str, user_env: Mapping[str, str]) -> NetworkChosen:
    """The interface carrying ``address`` (this machine's address as the others reach it),
    the variables to set for the workers, and what the hostname resolves to. Variables the
    user set in ``user_env`` (the job's ``--env``) or in this process's environment are
    kept. On loopback (every machine on this host) that is the loopback interface."""
    local = local_address(address)
    interface = interface_of(local)
    hostname = socket.gethostname()
    kept = _users(user_env)
    variables: tuple[tuple[str, str], ...] = ()
    if interface is not None:
        variables = tuple((name, interface) for name in INTERFACE_VARIABLES
                          if name not in dict(kept))
    return NetworkChosen(machine=local, interface=interface, variables=variables, kept=kept,
                         hostname=hostname, hostname_address=resolve(hostname))


def on_loopback(user_env: Mapping[str, str]) -> dict[str, str]:
    """A standalone job's variables: its ranks' process groups listen and connect on the
    loopback interface only, each variable unless the user set it (``user_env``, the job's
    ``--env``, or this process's environment). gloo and NCCL then bind to that
    interface's address instead of the one the hostname resolves to."""
    kept = dict(_users(user_env))
    return {name: loopback_interface() for name in INTERFACE_VARIABLES if name not in kept}


def _users(user_env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The interface variables the user set: the job's ``--env`` wins over this process's
    environment."""
    return tuple((name, user_env.get(name, os.environ.get(name, "")))
                 for name in INTERFACE_VARIABLES if name in user_env or name in os.environ)


@functools.cache
def loopback_interface() -> str:
    """The interface that carries 127.0.0.1 ("lo" on Linux)."""
    return interface_of(LOOPBACK) or "lo"


def local_address(host: str) -> str:
    """This machine's own IP address for ``host``, one of its addresses (a name such as
    the one given to --rdzv-endpoint): the source address a UDP "connect" picks (no packet
    is sent)."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return host
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
        except OSError:
            return str(sockaddr[0])


def resolve(hostname: str) -> str | None:
    """The address ``hostname`` resolves to here (as gloo finds it), or None."""
    try:
        return str(socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, IndexError):
        return None


def is_loopback(address: str | None) -> bool:
    """127.0.0.0/8 and ::1, also as an IPv4-mapped IPv6 address (::ffff:127.0.0.1)."""
    try:
        ip = ipaddress.ip_address((address or "").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def interface_of(address: str) -> str | None:
    """The name of the interface that carries ``address``, or None (not an address of
    this machine, or the interfaces cannot be listed)."""
    try:
        wanted = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    for name, found in interface_addresses():
        if found == wanted:
            return name
    return None


# -- getifaddrs(3), the one list of every interface's addresses (Linux layout) ---------------

class _SockAddr(ctypes.Structure):
    """C's struct sockaddr: an address family, then the family's bytes (port, address...)."""

    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _IfAddrs(ctypes.Structure):
    """C's struct ifaddrs, one entry of getifaddrs' linked list (fields set below: it
    points to itself)."""


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)), ("netmask", ctypes.POINTER(_SockAddr)),
    ("ifu", ctypes.c_void_p), ("data", ctypes.c_void_p),
]


def interface_addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """(interface, address) for every IPv4 and IPv6 address of this machine."""
    # The interpreter's own symbols hold the C library's: ctypes.util.find_library would run
    # ldconfig (a process) at every job's start.
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "getifaddrs"):  # no C library to ask: the event names no interface
        return []
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    found: list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.addr and item.name:
                family, data = item.addr.contents.family, bytes(item.addr.contents.data)
                name = item.name.decode(errors="replace")
                if family == socket.AF_INET:  # port (2), address (4)
                    found.append((name, ipaddress.IPv4Address(data[2:6])))
                elif family == socket.AF_INET6:  # port (2), flow info (4), address (16)
                    found.append((name, ipaddress.IPv6Address(data[6:22])))
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found
