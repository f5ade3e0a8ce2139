"""A real Slurm cluster on this host for the Slurm launcher's tests: Debian's munged,
slurmctld in the test's namespace (at the bridge's address) and one slurmd per machine of a
tests/netns.py network (``slurmd -N emN`` inside its namespace, ``NodeAddr`` its address),
so each allocation lands on a "machine" of its own. A job in partition ``urgent`` preempts
those in ``test`` (the default) as a real cluster's would: SIGTERM, then SIGKILL after the
partition's GraceTime (30 s). Everything (key, state, spool, logs,
sockets) lives in the test's temp folder; the clients find the cluster through SLURM_CONF,
which the fixture sets for the test. Root only, as the namespaces are."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from netns import Network

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "srun")


def unavailable() -> str | None:
    missing = [tool for tool in DAEMONS if not shutil.which(tool)
               and not Path("/usr/sbin", tool).exists()]
    return f"{', '.join(missing)} not installed (munge, slurmctld, slurmd, slurm-client)" \
        if missing else None


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _which(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"


class Slurm:
    def __init__(self, network: Network, folder: Path, cpus: int = os.cpu_count() or 1
                 ) -> None:
        self.network = network
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.cpus = cpus
        self.procs: list[subprocess.Popen[bytes]] = []

    def node(self, i: int) -> str:
        return f"em{i}"

    def start(self) -> dict[str, str]:
        """munged, slurmctld, the slurmds; the environment for Slurm's clients."""
        folder, network = self.folder, self.network
        for sub in ("munge", "state", "spool"):
            (folder / sub).mkdir(mode=0o700, parents=True)
        key = folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        (folder / "munge").chmod(0o711)  # munged wants its socket's folder searchable
        socket_path = folder / "munge" / "munge.socket"
        self._spawn("munged", [_which("munged"), "-F", "--force", f"--key-file={key}",
                               f"--socket={socket_path}", f"--pid-file={folder}/munge/pid",
                               f"--log-file={folder}/munge/log",
                               f"--seed-file={folder}/munge/seed"])
        self._wait(lambda: socket_path.exists(), "munged's socket")
        head = network.head_address
        nodes = "\n".join(
            f"NodeName={self.node(i)} NodeAddr={network.address(i)} NodeHostname="
            f"{self.node(i)} CPUs={self.cpus} RealMemory=100 State=UNKNOWN"
            for i in range(1, network.machines + 1))
        self.conf.write_text(f"""\
ClusterName=elastic
SlurmctldHost={socket.gethostname().split('.')[0]}({head})
MailProg=/bin/true
SlurmctldPort={_free_port(head)}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/backfill
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=5
KillWait=5
SlurmdTimeout=30
InactiveLimit=0
{nodes}
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
""")
        env = self.env()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(self.conf)],
                    env=env)
        for i in range(1, network.machines + 1):
            (folder / "spool" / self.node(i)).mkdir(mode=0o700)
            # nsenter, not `ip netns exec`: that remounts /sys without the cgroup
            # filesystem, and slurmd 22.05 will not start without it.
            self._spawn(f"slurmd-{i}", ["nsenter", f"--net=/run/netns/{network.namespace(i)}",
                                         _which("slurmd"), "-D", "-N", self.node(i),
                                         "-f", str(self.conf)], env=env)
        self._wait(self._all_idle, "every node idle in sinfo")
        return env

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        out = (self.folder / f"{name}.out").open("wb")
        self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=env))
        out.close()

    def idle(self) -> bool:
        """Every node idle (none allocated, completing or down)."""
        return self._all_idle()

    def _all_idle(self) -> bool:
        done = subprocess.run(["sinfo", "--noheader", "--format=%n %t"], env=self.env(),
                              capture_output=True, text=True)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return len(states) == self.network.machines and \
            all(s == "idle" for s in states.values())

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}) while "
                                       f"waiting for {what}: {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout:g}s: {self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(self.folder.glob("*.log")) +
                         sorted(self.folder.glob("*.out")) if p.is_file())

    def queue(self) -> list[str]:
        """Every job slurmctld still has that is not finished."""
        done = subprocess.run(["squeue", "--noheader", "--format=%i %T %r"],
                              env=self.env(), capture_output=True, text=True, check=True)
        return [line for line in done.stdout.splitlines() if line.strip()]

    def close(self) -> None:
        for proc in reversed(self.procs):  # ours, by PID
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def start_slurm(network: Network, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Slurm:
    reason = unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs Slurm and munge, but {reason}")
        pytest.skip(reason)
    slurm = Slurm(network, folder)
    try:
        env = slurm.start()
    except BaseException:
        slurm.close()
        raise
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    return slurm
