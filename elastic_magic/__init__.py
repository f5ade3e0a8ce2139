"""elastic_magic: run a Jupyter cell as an elastic distributed PyTorch job.

    %load_ext elastic_magic

    %%elastic --nproc 2 --max-restarts 1
    ...torchrun-style code...
"""

from __future__ import annotations

from typing import Any

from .agent.job import AgentError, Job
from .events import JobState
from .launch import launch
from .payload import PayloadError
from .result import JobFailedError, JobResult, RankFailure
from .spec import JobSpec, SpecError

__version__ = "0.1.0"

__all__ = [
    "AgentError",
    "Job",
    "JobFailedError",
    "JobResult",
    "JobSpec",
    "JobState",
    "PayloadError",
    "RankFailure",
    "SpecError",
    "launch",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: Any) -> None:
    from .magics import ElasticMagics

    ipython.register_magics(ElasticMagics)


def unload_ipython_extension(ipython: Any) -> None:
    magics = ipython.magics_manager.magics
    magics["cell"].pop("elastic", None)
