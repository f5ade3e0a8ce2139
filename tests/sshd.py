"""An OpenSSH server in each machine of a tests/netns.py network, for the SSH launcher's
tests: host keys, a client key and its authorized_keys made by the test (in its temp
folder), key authentication only, listening on the machine's own address."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import Network

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def unavailable() -> str | None:
    missing = [tool for tool in (SSHD, "ssh", "ssh-keygen") if not shutil.which(tool)]
    return f"{', '.join(missing)} not installed (openssh-server, openssh-client)" \
        if missing else None


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
                   check=True, capture_output=True)


def start_sshd(network: Network, folder: Path) -> dict[str, str]:
    """sshd in every machine; the ssh launcher's options that reach them (hosts,
    ssh_options with the test's key and known_hosts, python and PYTHONPATH of this tree)."""
    reason = unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs OpenSSH, but {reason}")
        pytest.skip(reason)
    folder.mkdir(mode=0o700)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation
    _keygen(folder / "host_key")
    _keygen(folder / "client_key")
    shutil.copy(folder / "client_key.pub", folder / "authorized_keys")
    for i in range(1, network.machines + 1):
        config = folder / f"sshd_config{i}"
        config.write_text(
            f"ListenAddress {network.address(i)}\nPort 22\nHostKey {folder / 'host_key'}\n"
            f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "PermitRootLogin prohibit-password\nPidFile none\nLogLevel ERROR\n"
            "AcceptEnv none\n")
        network.popen(i, [SSHD, "-D", "-e", "-f", str(config)])
    for i in range(1, network.machines + 1):
        _wait_for_port(network.address(i), 22, network)
    package_parent = str(Path(__file__).resolve().parents[1])
    return {
        "hosts": ",".join(network.address(i) for i in range(1, network.machines + 1)),
        "ssh_options": f"-i {folder / 'client_key'} -o IdentitiesOnly=yes "
                       f"-o UserKnownHostsFile={folder / 'known_hosts'} "
                       "-o StrictHostKeyChecking=accept-new",
        "python": sys.executable,
        "env": f"PYTHONPATH={package_parent}",
        "workdir": str(folder.parent),
    }


def _wait_for_port(host: str, port: int, network: Network, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                outputs = [network.output(p) for p in network.procs]
                raise RuntimeError(f"sshd on {host} did not listen: {outputs}") from None
            time.sleep(0.1)
