"""``--launcher local``: the "machines" are ``elastic-magic join`` processes on this
computer. For rehearsing a launcher job (the tutorial, a laptop) before pointing it at a
cluster: the same allocations, growth, give-back and cleanup as the SSH launcher, whose
mechanism it shares (the token on the join's stdin, the end of stdin its end)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..agent.node import interpreter
from ..checks import SpecError
from . import JoinRequest, known_options
from .ssh import SshLauncher

OPTIONS = {
    "machines": "how many join processes may run at once (default 8)",
    "nproc": "each one's workers: N, auto, cpu or gpu (default 1)",
}


class LocalLauncher(SshLauncher):
    """The SSH launcher with join processes on this computer for hosts: a launcher job
    rehearsed without a cluster."""

    name = "local"

    def __init__(self, options: Mapping[str, str]) -> None:
        known_options(self.name, options, OPTIONS)
        count = options.get("machines", "8")
        if not count.isdigit() or int(count) < 1:
            raise SpecError(f"--launch machines={count}: a number of processes, 1 or more.")
        super().__init__({"hosts": ",".join(f"local{i}" for i in range(1, int(count) + 1)),
                          "nproc": options.get("nproc", "1")})

    def _command(self, host: str, request: JoinRequest, allocation_id: str
                 ) -> tuple[list[str], dict[str, str]]:
        env = {k: v for k, v in os.environ.items() if k != "ELASTIC_MAGIC_TOKEN"}
        env["ELASTIC_MAGIC_ALLOCATION"] = allocation_id
        # this elastic_magic, and nothing from the notebook's folder (its cwd)
        argv = interpreter.command("elastic_magic.cli", "join", request.endpoint,
                                   "--token-stdin", "--nproc",
                                   self.nproc or request.nproc or "1")
        return argv, env
