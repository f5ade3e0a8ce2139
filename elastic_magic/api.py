"""The Python API: ``launch`` runs a function or source code as an elastic job."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .agent.job import Job, Renderer
from .events import JobState
from .payload import Payload, cell_payload, function_payload
from .result import JobFailedError, JobResult
from .spec import JobSpec
from .ui.text import TextRenderer


def build_payload(
    target: Callable[..., Any] | str, spec: JobSpec, *, args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None, namespace: dict[str, Any] | None = None,
) -> Payload:
    settings: dict[str, Any] = dict(
        argv=["<cell>", *spec.args], pull=spec.pull, backend=spec.backend,
        timeout=spec.timeout, init_process_group=spec.init_process_group, cwd=os.getcwd(),
    )
    if isinstance(target, str):
        return cell_payload(target, namespace or {}, **settings)
    return function_payload(target, args, kwargs or {}, **settings)


def launch(
    target: Callable[..., Any] | str,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    namespace: dict[str, Any] | None = None,
    nproc: int | str | None = None,
    max_restarts: int = 0,
    backend: str = "auto",
    monitor_interval: float = 0.1,
    timeout: float = 300.0,
    init_process_group: bool = True,
    log_dir: str | os.PathLike[str] | None = None,
    env: dict[str, str] | list[str] | None = None,
    argv: list[str] | None = None,
    pull: list[str] | None = None,
    min_nproc: int | None = None,
    max_nproc: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    nnodes: int | str | None = None,
    rdzv_endpoint: str | None = None,
    render: Renderer | None = None,
    check: bool = True,
) -> JobResult:
    """Run ``target`` on ``nproc`` workers as an elastic job and return its JobResult.

    ``target`` is a function (called as ``target(*args, **kwargs)`` on every rank; its
    return value is that rank's value) or source code (run as ``__main__``; its last
    expression is the value, and the globals it reads are taken from ``namespace``).
    With ``check`` (the default) a failed job raises JobFailedError. Output goes to
    ``render`` (default: plain text with ``[rank N]`` prefixes on stdout/stderr).
    """
    spec = JobSpec.create(
        nproc, backend=backend, max_restarts=max_restarts, monitor_interval=monitor_interval,
        timeout=timeout, init_process_group=init_process_group, log_dir=log_dir, env=env,
        args=argv, pull=pull, min_nproc=min_nproc, max_nproc=max_nproc,
        checkpoint_dir=checkpoint_dir, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
    )
    payload = build_payload(target, spec, args=args, kwargs=kwargs, namespace=namespace)
    result = Job(spec, payload).start().wait(render or TextRenderer())
    if check and result.state is JobState.FAILED:
        raise JobFailedError(result)
    return result
