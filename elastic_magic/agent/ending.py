"""How a job ends on this machine: release everything it held (each step even when an
earlier one raised), tell the other machines, and report its JobResult."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..events import JobFinished
from ..result import JobResult, JobState, assemble_result

if TYPE_CHECKING:
    from .supervisor import Agent


def finish(agent: Agent, final: JobState) -> JobResult:
    """Release everything the job held and tell the other machines, each step even when
    an earlier one raised; then report the result."""
    errors: list[BaseException] = []

    def attempt(release: Callable[[], object]) -> None:
        try:
            release()
        except Exception as exc:
            errors.append(exc)

    attempt(lambda: close_group(agent))
    attempt(lambda: _release_run_folder(agent))
    attempt(lambda: agent.role.close_rendezvous(agent.rendezvous))
    result: JobResult | None = None
    try:
        result = _result(agent, final)
    finally:
        attempt(agent.hangs.close)
        attempt(agent.snapshots.close)
        attempt(lambda: agent.set_state(final))
        attempt(lambda: agent.role.finished(final, agent.failures))
        if result is not None:
            attempt(lambda: agent.emit(JobFinished(result)))
        # The State server calls back into the agent: without this, the stores and pipes
        # would wait for the garbage collector (a notebook ran out of files).
        agent.server = agent.rendezvous = agent.group = None
    if errors:
        raise errors[0]
    return result


def _result(agent: Agent, final: JobState) -> JobResult:
    others, other_tails = agent.role.other_ranks(agent.round) \
        if final is JobState.SUCCEEDED else ({}, {})
    # The result is plain data: assembling it cannot fail on a released resource.
    group = agent.group
    return assemble_result(
        run_id=agent.run_id, state=final, world_size=agent.world_size,
        restarts=agent.restarts, max_restarts=agent.spec.max_restarts,
        started=agent.board.current.started, log_dir=agent.log_root,
        failures=agent.failures, stop_reason=agent.stop_reason,
        resizes=agent.membership.resizes, commit=agent.snapshots.meta,
        snapshot=agent.snapshots.blob,
        ranks={**(group.results() if group else {}), **others},
        tails={**(group.tails() if group else {}), **other_tails},
        stacks=agent.hangs.kept, excluded=[*agent.role.excluded, *agent.excluded],
    )


def _release_run_folder(agent: Agent) -> None:
    if agent.run_folder is not None:
        agent.log_root = agent.run_folder.where()  # the result points at the job's logs
        agent.run_folder.close()
        agent.run_folder = None


def close_group(agent: Agent) -> None:
    if agent.group is not None:
        agent.group.close()
        agent.board.publish(pids={})
