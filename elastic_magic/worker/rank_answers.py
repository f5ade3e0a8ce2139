"""Modules the warm pool may preload although they read a rank's variable when imported:
each keeps its answer in one known place, which every rank forked from the zygote sets
again from its own environment (``forked.take_job``) before its cell runs. Any other module
that reads one when imported is left out of the pool (``import_checks``).

Both known ones keep ``rank_zero_only.rank``, a public attribute their docs say to set:
Lightning's (lightning_utilities' function, set by ``lightning_fabric`` from RANK, else
LOCAL_RANK, SLURM_PROCID or JSM_NAMESPACE_RANK, else 0) and torchmetrics' own (from
LOCAL_RANK). Lightning's strategies set theirs again when they start; cells and callbacks
that run before (and torchmetrics always) rely on the import's answer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

_LIGHTNING_ORDER = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def _lightning() -> int:
    return next((int(os.environ[key]) for key in _LIGHTNING_ORDER if key in os.environ), 0)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


# the module that reads -> the per-rank variables it may read, and its answer from them
KNOWN: dict[str, tuple[frozenset[str], Callable[[], int]]] = {
    "lightning_fabric.utilities.rank_zero": (frozenset({"RANK", "LOCAL_RANK"}), _lightning),
    "torchmetrics.utilities.prints": (frozenset({"LOCAL_RANK"}), _local_rank),
}


def excused(module: str, variable: str) -> bool:
    """Whether ``module`` reading ``variable`` when imported is set right in every rank."""
    known = KNOWN.get(module)
    return known is not None and variable in known[0]


def set_again() -> None:
    """In a rank forked from the zygote, once its environment is the job's."""
    for name, (_, answer) in KNOWN.items():
        module = sys.modules.get(name)
        if module is not None:
            module.rank_zero_only.rank = answer()
