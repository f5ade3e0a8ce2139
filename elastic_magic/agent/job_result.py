"""How the agent makes a JobResult from what its ranks sent: values and pulled variables
(unpickled in the kernel) on success, the root cause on failure."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import cloudpickle

from ..result import JobResult, JobState, RankFailure
from ..result_parts import MemorySnapshot, MetricSeries, Unpicklable


class RankOutcome(Protocol):
    """A rank's result as its worker sent it (``messages.Result``)."""

    @property
    def value(self) -> bytes: ...
    @property
    def pulled(self) -> dict[str, bytes]: ...
    @property
    def missing(self) -> tuple[str, ...]: ...


def assemble_result(
    *, run_id: str, state: JobState, world_size: int, restarts: int, max_restarts: int,
    started: float, log_dir: Path, failures: list[RankFailure], stop_reason: str | None,
    resizes: int, commit: dict[str, Any] | None, snapshot: bytes | MemorySnapshot | None,
    ranks: Mapping[int, RankOutcome], tails: dict[int, list[str]],
    stacks: Mapping[int, str] | None = None, excluded: Sequence[str] = (),
    metrics: dict[str, MetricSeries] | None = None,
) -> JobResult:
    """The JobResult of a job that ended in ``state``: values and pulled variables only on
    success, the root cause only on failure."""
    failed = state is JobState.FAILED
    result = JobResult(
        run_id=run_id, state=state, world_size=world_size, restarts=restarts,
        max_restarts=max_restarts, duration=time.time() - started, log_dir=log_dir,
        failure=failures[0] if failed and failures else None,
        failures=list(failures) if failed else [],
        tails=dict(tails), stop_reason=stop_reason if state is JobState.STOPPED else None,
        resizes=resizes, commit=dict(commit) if commit else None,
        snapshot_source=snapshot,
        stacks=dict(stacks or {}) if failed else {}, excluded=list(excluded),
        started=started, metrics=metrics or {},
    )
    if state is JobState.SUCCEEDED:
        for rank in sorted(ranks):
            result.values[rank] = _load(ranks[rank].value)
            for name, blob in ranks[rank].pulled.items():
                result.pulled[name] = _load(blob)
            result.missing_pulls += ranks[rank].missing
    return result


def _load(blob: bytes) -> Any:
    try:
        return cloudpickle.loads(blob)
    except Exception as exc:  # e.g. a class the kernel cannot import
        return Unpicklable("<value from worker>", f"{type(exc).__name__}: {exc}")
