"""A rank's environment: the kernel's as every worker inherits it, and the variables torchrun
gives each rank."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .interpreter import without_relative_pythonpath
from .network import on_loopback

if TYPE_CHECKING:
    from ...spec import JobSpec
    from ...wire.events import NetworkChosen
    from ..round_info import RoundInfo
    from .workers import Worker


def _is_installed() -> bool:
    try:
        importlib.metadata.distribution("elastic-magic")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


_INSTALLED = _is_installed()


_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def inherited_env(nproc: int) -> dict[str, str]:
    """The kernel's environment as every worker of a machine running ``nproc`` inherits
    it, before its round's variables and the job's ``--env``."""
    env = dict(os.environ)
    if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
        del env["MPLBACKEND"]  # the inline backend needs a kernel; workers have none
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: workers sharing a machine
    if not _INSTALLED:  # running from a source checkout: workers must find the package
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT,
                                                          env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the notebook as they are printed
    return without_relative_pythonpath(env)


def torchrun_env(worker: Worker, info: RoundInfo, spec: JobSpec, *, nproc: int, run_id: str,
                 restart_count: int, error_file: Path,
                 network: NetworkChosen | None = None,
                 slots: list[int] | None = None) -> dict[str, str]:
    """The kernel's environment plus every variable torchrun sets, with its meaning, for
    ``worker`` of this machine's ``nproc`` in round ``info``; the interface chosen for this
    machine (``network``, a multi-node job; loopback for a standalone one); its worker
    slots (``slots``, see ``policy.Membership``); then the job's ``--env``."""
    world_size = info.world_size
    env = inherited_env(nproc)
    env.update({
        "RANK": str(worker.global_rank),
        "LOCAL_RANK": str(worker.local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(info.node_rank),
        "GROUP_WORLD_SIZE": str(info.nnodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(worker.global_rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": str(error_file),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                          "1"),
        # init_process_group returns once every rank's group is up (a store barrier): gloo
        # lets a rank out as soon as its own end of each pair is, and one whose cell then
        # ends closes a pair its peer is still setting up ("connectFullMesh failed ...
        # Connection closed by peer"; a short cell's group failed 1 run in 8 under load).
        # The same on every machine (a rank in the barrier would wait for one that is not):
        # not from this machine's environment; the job's --env may set it.
        "TORCH_DIST_INIT_BARRIER": "1",
    })
    if network is not None:
        env.update(network.variables)
    elif not spec.multi_node:  # one machine: its process groups on loopback, never the network
        env.update(on_loopback(spec.env))
    slots = slots or list(range(nproc))
    env["ELASTIC_MAGIC_SLOT"] = str(slots[worker.local_rank])
    visible = os.environ["CUDA_VISIBLE_DEVICES"].split(",") \
        if os.environ.get("CUDA_VISIBLE_DEVICES") else [str(i) for i in range(spec.gpus)]
    if spec.gpus and slots != list(range(nproc)) and max(slots) < len(visible):
        # A GPU left out: LOCAL_RANK i must still be the i-th visible GPU (the cell, as
        # torchrun's scripts do, calls set_device(LOCAL_RANK)).
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[s] for s in slots)
    env.update(spec.env)
    return env
