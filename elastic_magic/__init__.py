"""elastic_magic: run a Jupyter cell as an elastic distributed PyTorch job.

    %load_ext elastic_magic

    %%elastic --nproc 2 --max-restarts 1
    ...torchrun-style code...

The public names are imported on first use, so a worker process (which imports
``elastic_magic.worker``) does not pay for the agent's imports.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .agent.handles.attached import AttachedJob, DetachedError, attach, detached_jobs
    from .agent.handles.job import AgentError, Job
    from .notebook.api import launch
    from .notebook.session import Session, SessionEndedError
    from .result import JobFailedError, JobResult, RankFailure
    from .spec import JobSpec, SpecError
    from .training.data import DataLoader, ElasticSampler
    from .training.log import log
    from .training.resume import run
    from .training.state import State
    from .wire.events import JobState
    from .wire.payload import PayloadError

__version__ = "0.1.0"

_EXPORTS = {
    "AgentError": ".agent.handles.job",
    "AttachedJob": ".agent.handles.attached",
    "DetachedError": ".agent.handles.attached",
    "attach": ".agent.handles.attached",
    "detached_jobs": ".agent.handles.attached",
    "Job": ".agent.handles.job",
    "JobFailedError": ".result",
    "JobResult": ".result",
    "JobSpec": ".spec",
    "JobState": ".wire.events",
    "PayloadError": ".wire.payload",
    "RankFailure": ".result",
    "SpecError": ".spec",
    "Session": ".notebook.session",
    "SessionEndedError": ".notebook.session",
    "DataLoader": ".training.data",
    "ElasticSampler": ".training.data",
    "State": ".training.state",
    "launch": ".notebook.api",
    "log": ".training.log",
    "run": ".training.resume",
}

__all__ = [
    "AgentError",
    "AttachedJob",
    "DataLoader",
    "DetachedError",
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
    "attach",
    "detached_jobs",
    "launch",
    "load_ipython_extension",
    "log",
    "run",
    "unload_ipython_extension",
]


# Where modules users may have imported lived before the package was regrouped: each old
# name is the new module itself (imports, pickles and checkpoints that name it keep working).
_MOVED = {
    "api": "notebook.api",
    "data": "training.data",
    "events": "wire.events",
    "magics": "notebook.magics",
    "payload": "wire.payload",
    "resume": "training.resume",
    "session": "notebook.session",
    "state": "training.state",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``elastic_magic.<old>`` as the module now at its new place."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        old = fullname.removeprefix(__name__ + ".")
        if fullname.startswith(__name__ + ".") and old in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(f"{__name__}.{_MOVED[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the module was run at its new place."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


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

    from .agent.node.environment import inherited_env
    from .agent.node.pool import prewarm

    # The warm pool's zygote imports torch while the kernel imports the magics: the first
    # cell finds it ready. Made for several workers per machine (OMP_NUM_THREADS=1), the
    # usual case; a job that inherits something else starts its own.
    prewarm(inherited_env(nproc=2), os.getcwd(), sys.path)
    from .notebook.magics import ElasticMagics

    ipython.register_magics(ElasticMagics)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop this kernel's running jobs and its session, end the warm pool and remove both
    magics (``%unload_ext elastic_magic``).

    Args:
        ipython: The IPython shell that unloads the extension.
    """
    from .agent.node.pool import shutdown_pool

    magics = ipython.magics_manager.registry.pop("ElasticMagics", None)
    if magics is not None:
        magics.stop_all()
    shutdown_pool()
    ipython.magics_manager.magics["cell"].pop("elastic", None)
    ipython.magics_manager.magics["line"].pop("elastic", None)
