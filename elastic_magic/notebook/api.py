"""The Python API: ``launch`` runs a function or source code as an elastic job."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..agent.handles import detached_launch
from ..agent.handles.job import Job, Renderer
from ..result import JobFailedError, JobResult
from ..spec import JobSpec, options_help
from ..ui.text import TextRenderer
from ..wire.events import JobState
from ..wire.payload import build_payload


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

    Blocks until the job ends. Ctrl-C stops the workers, then raises KeyboardInterrupt;
    with ``detach=True`` the job's agent runs in a process of its own and Ctrl-C only stops
    the wait (``elastic_magic.attach(run_id)`` follows it again).

    Args:
        target: A function, called as ``target(*args, **kwargs)`` on every rank (its
            return value is that rank's value), or source code, run as ``__main__`` (its
            last expression is the value).
        args: Positional arguments for a function ``target``.
        kwargs: Keyword arguments for a function ``target``.
        namespace: Where source code's globals are taken from (default: none); each
            travels to the workers by value, modules by name.
        render: Takes each batch of the job's events. Default: plain text, with
            ``[rank N]`` prefixes, on stdout/stderr.
        check: Raise JobFailedError if the job fails.
        **options: The job's options, as the %%elastic flags (listed below).

    Returns:
        The JobResult: state, each rank's value, the root cause of a failure, logs.

    Raises:
        TypeError: An unknown option (before anything starts).
        SpecError: An option's value is invalid (before anything starts).
        PayloadError: ``target`` or a global it reads cannot be sent to the workers.
        JobFailedError: The job failed after its restarts (with ``check``).
        AgentError: The agent itself failed; the workers were stopped.

    Example:
        >>> result = elastic_magic.launch(train, args=(0.1,), nproc=2, max_restarts=1)
        >>> result.values  # {0: ..., 1: ...}

    Options:"""
    spec = JobSpec.create(**options)
    payload = build_payload(target, spec, args=args, kwargs=kwargs, namespace=namespace)
    job = detached_launch.start(spec, payload, title=getattr(target, "__name__", "launch")) \
        if spec.detach else Job(spec, payload).start()
    result = job.wait(render or TextRenderer())
    if check and result.state is JobState.FAILED:
        raise JobFailedError(result)
    return result


if launch.__doc__:  # absent under python -OO
    launch.__doc__ += "\n" + options_help() + "\n"
