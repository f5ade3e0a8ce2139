"""Machines on one host: network namespaces joined by a bridge, for tests (root only).

    from netns import network          # the fixture (3 machines; indirect param for another N)

    def test_x(network):
        network.head_address           # "10.213.X.254": the bridge, in the test's namespace;
                                       # bind the head (the kernel's agent) there
        network.address(i)             # "10.213.X.i", machine i = 1..N
        proc = network.join(i, endpoint, token, nproc=1, log_dir=..., out=...)
        proc = network.popen(i, [sys.executable, "script.py"], ...)   # any command
        network.cut(i); network.restore(i)   # machine i's link down / up
        network.output(proc)           # what a join/popen process printed

Each machine is a namespace with its own loopback, one veth link to a bridge in the test's
namespace and an address 10.213.X.i/24; machines reach each other and the head only through
those addresses (nothing is forwarded to the host's own networks). Every process started in
machine i also gets a hostname of its own (``em-machine-i``, a UTS namespace) that its
``/etc/hosts`` maps to 127.0.1.1, as a stock Debian or Ubuntu install does: whatever picks
its address from the hostname (gloo does) gets loopback, as on real machines. With
``hostnames="own"`` it maps to the machine's own address instead, as on many servers. The test's own
namespace resolves its hostname as the host does (here to 127.0.0.1).

X is free among the networks that exist (chosen under a lock, so parallel test runs never
share one); names carry X and a random part. Everything is torn down afterwards, also when
the test fails: the processes started here (by PID), whatever still runs in the namespaces,
the namespaces, links, bridge and ``/etc/netns`` files. What a test process killed outright
left behind is listed in a record under the temp folder and removed by the next network
built, once that process is gone.

Where namespaces cannot be made (not root, no ``ip`` or ``unshare``, no permission), tests
using them are skipped, except under CI (``CI`` set): CI runs as root, so there a skip would
hide a failure and the fixture fails instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

SUBNET = "10.213"
HEAD_HOST = 254  # the bridge's host number: the test's namespace
_LOCK = Path(tempfile.gettempdir()) / "elastic_magic_netns.lock"
_RECORDS = Path(tempfile.gettempdir()) / "elastic_magic_netns"  # what each network made
_NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (iproute2, util-linux)"
    return None


class Network:
    """A bridge with ``machines`` namespaces on it; see the module's docstring."""

    def __init__(self, machines: int, directory: Path, hostnames: str = "loopback") -> None:
        assert hostnames in ("loopback", "own")
        self.machines = machines
        self.hostnames = hostnames  # what each machine's hostname resolves to there
        self.directory = directory  # where processes' output goes
        self.procs: list[subprocess.Popen[bytes]] = []
        self._outputs: dict[int, Path] = {}
        self._made: list[tuple[str, str]] = []  # what to remove: ("netns"|"link"|"etc", name)
        self.subnet = 0
        self.tag = secrets.token_hex(2)

    # -- names and addresses -------------------------------------------------------------

    @property
    def bridge(self) -> str:
        return f"em{self.subnet}{self.tag}br"

    def namespace(self, i: int) -> str:
        return f"elastic-magic-{self.subnet}-{self.tag}-{i}"

    def veth(self, i: int) -> str:
        """Machine i's link as seen from the test's namespace (``cut`` takes it down)."""
        return f"em{self.subnet}{self.tag}v{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{self.subnet}.{i}"

    @property
    def head_address(self) -> str:
        return self.address(HEAD_HOST)

    @staticmethod
    def hostname(i: int) -> str:
        return f"em-machine-{i}"

    # -- building and tearing down -------------------------------------------------------

    def __enter__(self) -> Network:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _record(self) -> Path:
        return _RECORDS / f"{self.subnet}-{self.tag}.json"

    def _note(self, kind: str, name: str) -> None:
        """Remember what was made, here and on disk (for a test process killed outright)."""
        self._made.append((kind, name))
        self._record.write_text(json.dumps({"pid": os.getpid(), "made": self._made}))

    def _build(self) -> None:
        with _LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed: the bridge holds X then
            _remove_orphans()
            used = {line.split()[3].split(".")[2] for line in
                    _ip("-o", "-4", "addr", "show").splitlines()
                    if line.split()[3].startswith(f"{SUBNET}.")}
            free = [x for x in range(1, 250) if str(x) not in used]
            if not free:
                raise RuntimeError(f"no free {SUBNET}.X.0/24 network")
            self.subnet = random.choice(free)
            _RECORDS.mkdir(exist_ok=True)
            _ip("link", "add", self.bridge, "type", "bridge")
            self._note("link", self.bridge)
            _ip("addr", "add", f"{self.head_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for i in range(1, self.machines + 1):
            self._add_machine(i)

    def _add_machine(self, i: int) -> None:
        name = self.namespace(i)
        etc = _NETNS_ETC / name  # `ip netns exec` binds these over /etc
        etc.mkdir(parents=True)
        self._note("etc", str(etc))
        resolved = self.address(i) if self.hostnames == "own" else "127.0.1.1"
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{resolved} {self.hostname(i)}\n"
                                   "::1 localhost ip6-localhost ip6-loopback\n")
        _ip("netns", "add", name)
        self._note("netns", name)
        _ip("link", "set", "lo", "up", netns=name)
        inside = f"{self.veth(i)}p"
        _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", inside)
        self._note("link", self.veth(i))
        _ip("link", "set", inside, "netns", name)
        _ip("link", "set", inside, "name", "eth0", netns=name)  # as a machine would call it
        _ip("addr", "add", f"{self.address(i)}/24", "dev", "eth0", netns=name)
        _ip("link", "set", "eth0", "up", netns=name)
        _ip("link", "set", self.veth(i), "master", self.bridge)
        _ip("link", "set", self.veth(i), "up")

    def close(self) -> None:
        """End what runs in the namespaces, then remove everything made (each step runs
        even if one before it failed)."""
        for proc in self.procs:
            _end(proc)
        _remove(self._made)
        self._made.clear()
        self._record.unlink(missing_ok=True)

    # -- using it ------------------------------------------------------------------------

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run in machine i, under its own hostname."""
        return ["ip", "netns", "exec", self.namespace(i), "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname(i), *argv]

    def popen(self, i: int, argv: Sequence[str], *, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in machine i (stdout and stderr to a file: ``output(proc)``); it is
        ended at teardown if still running. The PID is that of ``argv`` itself (each step
        of ``command`` execs the next)."""
        out = self.directory / f"machine{i}-{len(self.procs)}.out"
        with out.open("wb") as file:
            proc = subprocess.Popen(self.command(i, argv), stdout=file,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env if env is not None else dict(os.environ),
                                    cwd=cwd or self.directory)
        self.procs.append(proc)
        self._outputs[proc.pid] = out
        return proc

    def join(self, i: int, endpoint: str, token: str | None, *, nproc: int = 1,
             log_dir: Path | None = None, extra: Sequence[str] = (),
             env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``elastic-magic join ENDPOINT`` in machine i, the token in its environment as the
        notebook prints it (None: no token at all)."""
        environ = {k: v for k, v in os.environ.items() if k != "ELASTIC_MAGIC_TOKEN"}
        if token is not None:
            environ["ELASTIC_MAGIC_TOKEN"] = token
        environ.update(env or {})
        logs = log_dir or self.directory / f"machine{i}-logs"
        return self.popen(i, [sys.executable, "-m", "elastic_magic.cli", "join", endpoint,
                              "--nproc", str(nproc), "--log-dir", str(logs), *extra],
                          env=environ)

    def output(self, proc: subprocess.Popen[bytes]) -> str:
        return self._outputs[proc.pid].read_text(errors="replace")

    def cut(self, i: int) -> None:
        """Machine i's link goes down: its packets are dropped, nothing is closed."""
        _ip("link", "set", self.veth(i), "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")


def _remove(made: Sequence[Sequence[str]]) -> None:
    """Remove what a network made, newest first; whatever still runs in its namespaces was
    started there by its test, so it is ended first (each step runs whatever failed)."""
    for kind, name in made:
        if kind == "netns":
            for pid in _ip("netns", "pids", name, check=False).split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
    for kind, name in reversed(made):
        with contextlib.suppress(Exception):
            if kind == "netns":
                _ip("netns", "del", name)
            elif kind == "link":
                _ip("link", "del", name, check=False)
            else:
                shutil.rmtree(name)


def _remove_orphans() -> None:
    """Networks whose test process is gone (killed before its teardown): removed."""
    for record in _RECORDS.glob("*.json") if _RECORDS.is_dir() else ():
        try:
            found = json.loads(record.read_text())
            os.kill(found["pid"], 0)
        except ProcessLookupError:
            _remove(found["made"])
        except PermissionError:
            continue  # alive
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: only the record goes
        else:
            continue  # its process is alive: it tears its network down itself
        record.unlink(missing_ok=True)


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Ours, by PID: SIGINT (an agent stops its workers), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, grace in ((signal.SIGINT, 15.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def network_of(machines: int, directory: Path, hostnames: str = "loopback"
               ) -> Iterator[Network]:
    """A Network, skipped where it cannot be made (a failure under CI)."""
    reason = unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root with iproute2, but {reason}")
        pytest.skip(reason)
    try:
        net = Network(machines, directory, hostnames).__enter__()
    except RuntimeError as exc:  # e.g. in a container without CAP_NET_ADMIN
        if os.environ.get("CI") or "not permitted" not in str(exc):
            raise
        pytest.skip(f"network namespaces cannot be made here: {exc}")
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def network(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Network]:
    """A bridge and 3 machines (``@pytest.mark.parametrize("network", [N], indirect=True)``
    for another number), torn down after the test."""
    with network_of(getattr(request, "param", 3), tmp_path) as net:
        yield net
