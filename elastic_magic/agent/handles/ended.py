"""What the kernel keeps of a job that has ended, for ``%elastic jobs`` and the jobs panel:
its status, root cause, summary and kept stacks, not its values, pulled variables, State
snapshot or output tails (a notebook runs hundreds of cells; its cells' results are the
user's to keep)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...result import JobResult, JobState
from ...spec import JobSpec
from ..status import JobStatus
from .job import Job


@dataclass(frozen=True)
class EndedJob:
    """A finished Job, as the history lists it; answers what a Job answers once ended."""

    run_id: str
    spec: JobSpec
    status_snapshot: JobStatus
    log_dir: Path
    result: JobResult | None  # without values, pulled variables, snapshot, tails, metrics
    _status: dict[str, Any]
    link_lost: bool = False  # a detached job's: see AttachedJob

    @classmethod
    def of(cls, job: Job) -> EndedJob:
        result = job.result
        if result is not None:
            result = dataclasses.replace(result, values={}, pulled={}, snapshot_source=None,
                                         tails={}, metrics={})
        return cls(job.run_id, job.spec, job.status_snapshot, job.log_dir, result,
                   job.status(), job.link_lost)

    done = True

    @property
    def state(self) -> JobState:
        return self.status_snapshot.state

    def status(self) -> dict[str, Any]:
        return dict(self._status)

    def stacks(self, timeout: float = 10.0) -> dict[int, str]:
        """The stacks it kept of its stuck ranks when it failed by a timeout or a stall."""
        return dict(self.result.stacks) if self.result is not None else {}

    def request_stacks(self) -> Future[dict[int, str]]:
        answer: Future[dict[int, str]] = Future()
        answer.set_result(self.stacks())
        return answer

    def stop(self, reason: str = "stopped") -> None:
        """Nothing to stop: its workers have exited."""

    def end(self, reason: str) -> None:
        """Nothing to end."""

    def wait_done(self, timeout: float | None = None) -> bool:
        return True

    def scale(self, nproc: int, immediate: bool = False, include: Iterable[int] = ()) -> None:
        raise ValueError(f"{self.run_id} has already ended.")

    def scale_nodes(self, nodes: int) -> None:
        raise ValueError(f"{self.run_id} has already ended.")
