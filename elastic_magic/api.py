"""The Python API: ``launch`` runs a function or source code as an elastic job."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .agent.handles.job import Job, Renderer
from .events import JobState
from .payload import build_payload
from .result import JobFailedError, JobResult
from .spec import JobSpec, options_help
from .ui.text import TextRenderer


def launch(
    target: Callable[..., Any] | str,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    namespace: dict[str, Any] | None = None,
    render: Renderer | None = None,
    check: bool = True,
    **options: Any,
) -> JobResult:
    """Run ``target`` on ``nproc`` workers as an elastic job and return its JobResult.

    ``target`` is a function (called as ``target(*args, **kwargs)`` on every rank; its
    return value is that rank's value) or source code (run as ``__main__``; its last
    expression is the value, and the globals it reads are taken from ``namespace``).
    With ``check`` (the default) a failed job raises JobFailedError. Output goes to
    ``render`` (default: plain text with ``[rank N]`` prefixes on stdout/stderr).

    ``options`` are the job's, as the %%elastic flags (an unknown one is a TypeError, a
    bad value a SpecError, both before anything starts):
    """
    spec = JobSpec.create(**options)
    payload = build_payload(target, spec, args=args, kwargs=kwargs, namespace=namespace)
    result = Job(spec, payload).start().wait(render or TextRenderer())
    if check and result.state is JobState.FAILED:
        raise JobFailedError(result)
    return result


if launch.__doc__:  # absent under python -OO
    launch.__doc__ += "\n" + options_help() + "\n"
