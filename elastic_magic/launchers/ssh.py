"""``--launcher ssh``: machines reached with the system's ``ssh`` (keys, no prompts).

Each allocation is one ``ssh HOST elastic-magic join ENDPOINT --token-stdin`` whose stdin
stays a pipe from the kernel: the token is its first line (never on a command line, here or
there), and the pipe's end is the machine's signal to leave. Closing it (a cancel), or the
kernel dying (the kernel held the only write end), makes the remote join leave the job and
exit; the SSH session ends with it. ``ssh`` runs in a session of its own so that a kernel
interrupt, sent to the kernel's process group, does not reach it.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import shlex
import subprocess
import threading
from collections.abc import Mapping

from ..agent.node import interpreter
from ..checks import SpecError
from . import Allocation, JoinRequest, LauncherError, known_options
from .watchdog import lifeline

OPTIONS = {
    "hosts": "the machines, comma-separated ([user@]host[:port]); each runs one join",
    "python": "the remote interpreter that has elastic_magic (default: the elastic-magic "
              "command on the remote PATH)",
    "workdir": "the remote working directory (default: the remote login's)",
    "env": "remote environment, space-separated K=V (e.g. PYTHONPATH=/src); words of the "
           "remote command line, which other users there can read: no secrets",
    "ssh": "the ssh program (default ssh)",
    "ssh_options": "extra ssh arguments, shell-quoted (e.g. -i ~/.ssh/lab -o "
                   "UserKnownHostsFile=~/.ssh/lab_hosts)",
    "nproc": "each machine's workers: N, auto, cpu or gpu (default: its own)",
}
_GRACE = 20.0  # seconds a remote join has to leave after its stdin closed


class _Remote:
    """One ssh client process and the last lines it printed."""

    def __init__(self, host: str, proc: subprocess.Popen[bytes]) -> None:
        self.host = host
        self.proc = proc
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.cancelled = False
        self.reader = threading.Thread(target=self._read, daemon=True,
                                       name=f"elastic-ssh-{host}")
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.decode(errors="replace").rstrip())

    def close_stdin(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def end(self, grace: float) -> None:
        """Its stdin closed: the remote join leaves; after ``grace`` the client is ended
        (ours, by PID; ending it closes the session, which ends the remote command)."""
        self.close_stdin()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=5)


class SshLauncher:
    """The launcher that runs a join on each of a fixed list of hosts: one allocation is one
    ``ssh`` session, ended by closing its stdin."""

    name = "ssh"

    def __init__(self, options: Mapping[str, str]) -> None:
        known_options(self.name, options, OPTIONS)
        self.hosts = [h.strip() for h in options.get("hosts", "").split(",") if h.strip()]
        if not self.hosts:
            raise SpecError("--launcher ssh needs hosts: --launch hosts=HOST1,HOST2 (or "
                            "hosts in the [ssh] table of the launcher config).")
        for host in self.hosts:
            if host.startswith("-"):  # ssh would read it as an option (-oProxyCommand=...)
                raise SpecError(f"--launch hosts: {host!r} is not a host name ([user@]host"
                                "[:port]); ssh options go in ssh_options.")
        try:
            self.ssh = [options.get("ssh", "ssh"), *shlex.split(options.get("ssh_options", ""))]
            env = shlex.split(options.get("env", ""))
        except ValueError as exc:
            raise SpecError(f"--launcher ssh: {exc}") from None
        if any("=" not in item for item in env):
            raise SpecError(f"--launch env={options['env']}: write K=V, space-separated.")
        self.env = env
        self.python = options.get("python")
        self.workdir = options.get("workdir")
        self.nproc = options.get("nproc")
        self._remotes: dict[str, _Remote] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _remote_command(self, request: JoinRequest, allocation_id: str) -> str:
        """The command line the remote shell runs: no token in it."""
        nproc = self.nproc or request.nproc
        args = ["join", request.endpoint, "--token-stdin", *(("--nproc", nproc) if nproc else ())]
        # not ``-m``: that would import from the workdir first
        join = interpreter.remote_command(self.python, "elastic_magic.cli", *args) \
            if self.python else ["elastic-magic", *args]
        words = ["exec", "env", f"ELASTIC_MAGIC_ALLOCATION={allocation_id}", *self.env, *join]
        command = shlex.join(words)
        return f"cd {shlex.quote(self.workdir)} && {command}" if self.workdir else command

    def _command(self, host: str, request: JoinRequest, allocation_id: str
                 ) -> tuple[list[str], dict[str, str]]:
        """The ssh client's argv and environment (without the token)."""
        target, _, port = host.partition(":")
        argv = [*self.ssh, "-o", "BatchMode=yes", *(("-p", port) if port else ()),
                "--", target, self._remote_command(request, allocation_id)]
        return argv, {k: v for k, v in os.environ.items() if k != "ELASTIC_MAGIC_TOKEN"}

    def _free_host(self) -> str:
        busy = [r.host for r in self._remotes.values()
                if r.proc.poll() is None and not r.cancelled]
        for host in self.hosts:
            if host not in busy:
                return host
        raise LauncherError(f"every host of the ssh launcher runs a machine of this job "
                            f"({', '.join(self.hosts)}); add hosts to grow further.")

    def start(self, request: JoinRequest) -> Allocation:
        with self._lock:
            host = self._free_host()
            allocation_id = f"{host}#{next(self._ids)}"
            argv, env = self._command(host, request, allocation_id)
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        env=env)
            except OSError as exc:
                raise LauncherError(f"cannot run {argv[0]}: {exc}") from None
            assert proc.stdin is not None
            lifeline(proc.stdin)  # its end is the remote join's: no forked child holds it
            with contextlib.suppress(OSError):  # a client that failed at once says why
                proc.stdin.write(request.token.encode() + b"\n")
                proc.stdin.flush()
            self._remotes[allocation_id] = _Remote(host, proc)
        return self._describe(allocation_id, self._remotes[allocation_id])

    @staticmethod
    def _describe(allocation_id: str, remote: _Remote) -> Allocation:
        code = remote.proc.poll()
        if code is None:
            return Allocation(allocation_id, "running", where=remote.host)
        last = remote.tail[-1] if remote.tail else ""
        return Allocation(allocation_id, "ended", f"exit {code}" + (f": {last}" if last
                                                                     else ""), remote.host)

    def allocations(self) -> list[Allocation]:
        with self._lock:
            return [self._describe(i, r) for i, r in self._remotes.items() if not r.cancelled]

    def cancel(self, allocation_id: str) -> None:
        with self._lock:
            remote = self._remotes.get(allocation_id)
            if remote is None:
                return
            remote.cancelled = True
        remote.end(_GRACE)
        with self._lock:
            self._remotes.pop(allocation_id, None)

    def cancel_all(self) -> None:
        with self._lock:
            remotes = list(self._remotes.values())
            self._remotes.clear()
        for remote in remotes:  # every machine hears at once, then each is waited for
            remote.cancelled = True
            remote.close_stdin()
        for remote in remotes:
            remote.end(_GRACE)

    def orphan_cleanup(self, allocation_id: str) -> list[list[str]]:
        return []  # the kernel's end closes the ssh client's stdin: the join leaves

    def orphan_files(self) -> list[str]:
        return []  # the token goes on stdin

