"""elastic_magic: run a Jupyter cell as an elastic distributed PyTorch job.

    %load_ext elastic_magic

    %%elastic --nproc 2 --max-restarts 1
    ...torchrun-style code...

The public names are imported on first use, so a worker process (which imports
``elastic_magic.worker``) does not pay for the agent's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .agent.handles.job import AgentError, Job
    from .api import launch
    from .data import DataLoader, ElasticSampler
    from .events import JobState
    from .payload import PayloadError
    from .result import JobFailedError, JobResult, RankFailure
    from .resume import run
    from .session import Session, SessionEndedError
    from .spec import JobSpec, SpecError
    from .state import State

__version__ = "0.1.0"

_EXPORTS = {
    "AgentError": ".agent.handles.job",
    "Job": ".agent.handles.job",
    "JobFailedError": ".result",
    "JobResult": ".result",
    "JobSpec": ".spec",
    "JobState": ".events",
    "PayloadError": ".payload",
    "RankFailure": ".result",
    "SpecError": ".spec",
    "Session": ".session",
    "SessionEndedError": ".session",
    "DataLoader": ".data",
    "ElasticSampler": ".data",
    "State": ".state",
    "launch": ".api",
    "run": ".resume",
}

__all__ = [
    "AgentError",
    "DataLoader",
    "ElasticSampler",
    "Job",
    "JobFailedError",
    "JobResult",
    "JobSpec",
    "JobState",
    "PayloadError",
    "RankFailure",
    "Session",
    "SessionEndedError",
    "SpecError",
    "State",
    "launch",
    "load_ipython_extension",
    "run",
    "unload_ipython_extension",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'elastic_magic' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%%elastic`` and ``%elastic`` magics (``%load_ext elastic_magic``).

    It also starts the warm pool on a thread: a process that imports torch while the
    kernel goes on, from which the first cell's workers are forked.

    Args:
        ipython: The IPython shell that loads the extension.
    """
    import os
    import sys

    from .agent.local.environment import inherited_env
    from .agent.local.pool import prewarm

    # The warm pool's zygote imports torch while the kernel imports the magics: the first
    # cell finds it ready. Made for several workers per machine (OMP_NUM_THREADS=1), the
    # usual case; a job that inherits something else starts its own.
    prewarm(inherited_env(nproc=2), os.getcwd(), sys.path)
    from .magics import ElasticMagics

    ipython.register_magics(ElasticMagics)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop this kernel's running jobs and its session, end the warm pool and remove both
    magics (``%unload_ext elastic_magic``).

    Args:
        ipython: The IPython shell that unloads the extension.
    """
    from .agent.local.pool import shutdown_pool

    magics = ipython.magics_manager.registry.pop("ElasticMagics", None)
    if magics is not None:
        magics.stop_all()
    shutdown_pool()
    ipython.magics_manager.magics["cell"].pop("elastic", None)
    ipython.magics_manager.magics["line"].pop("elastic", None)
