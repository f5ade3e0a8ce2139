"""Runs one payload in a worker: set up like torchrun, execute, report result or error."""

from __future__ import annotations

import ast
import builtins
import contextlib
import gc
import importlib
import linecache
import os
import sys
import time
import traceback
import types
from typing import Any

import cloudpickle

from elastic_magic import torch_internals
from elastic_magic.result_parts import Unpicklable
from elastic_magic.stacks import CELL_FILENAME, PACKAGE_DIR, drop_locals
from elastic_magic.training import log as metrics_log
from elastic_magic.wire.messages import (
    ErrorInfo,
    Failed,
    Imported,
    Parked,
    Resized,
    Result,
    Running,
)
from elastic_magic.wire.payload import Payload
from elastic_magic.worker import imports, leave, progress, replay_alone
from elastic_magic.worker import session_cells as session
from elastic_magic.worker.client import AgentClient, ResizeExit


def run_payload(payload: Payload, report: AgentClient, *, stay: bool = False) -> None:
    """Run the payload and send its Result, or Failed and exit (a session's cell: Failed,
    and the worker waits for the next cell). ``stay`` (survivors stay): after an error,
    at a resize or on the agent's Interrupt, the rank parks instead of exiting: it reports,
    drops its process group and waits for the next Run."""
    namespace: dict[str, Any] = {}
    value = None
    progress.running.set()
    metrics_log.reset()
    leave.running(payload, stay)
    try:
        namespace = _prepare(payload)
        report.send(Running(time.time(), os.getpid()))
        alone = replay_alone.no_collectives() if payload.replayed_alone \
            else contextlib.nullcontext()
        with session.running_cell() if payload.session else contextlib.nullcontext(), \
                leave.leavable() if stay else contextlib.nullcontext(), alone:
            value = _execute(payload, namespace)
    except leave.RerunCell:  # a survivor that went on in its cell must start it again
        return drop_cell(namespace)
    except ResizeExit as exc:  # a resize was applied at a commit: leave cleanly
        metrics_log.flush(report)
        report.send(Resized(exc.step, time.time()))
        if stay:
            return _park(report, exc, namespace)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except SystemExit as exc:  # sys.exit(0) ends the cell successfully, as under torchrun
        if exc.code not in (None, 0):
            code = exc.code if isinstance(exc.code, int) else 1
            return _fail(report, exc, exit_code=code, leave=not payload.session)
    except BaseException as exc:  # user code may raise anything
        if stay and why_parked(exc) is not None:  # reported; the agent decides who stays
            return _park(report, exc, namespace)
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        return _fail(report, exc, exit_code=code, leave=not payload.session)
    try:
        report.drain()  # the cell's last commit is in the agent before its result
    except BaseException as exc:
        return _fail(report, exc, exit_code=1, leave=not payload.session)
    progress.running.clear()
    message = _result_message(payload, value, namespace)
    if payload.session:
        session.end_output()
    report_imports(report)
    metrics_log.flush(report)
    report.send(message)
    from elastic_magic.worker import default_group

    default_group.release_destroyed()


def report_imports(report: AgentClient) -> None:
    """Tell the pool what this cell imported beyond the zygote (a pooled worker only), so
    the next cells' workers have it already."""
    with contextlib.suppress(Exception):  # a module in sys.modules may be anything
        if modules := imports.new_modules():
            report.send(Imported(tuple(modules)))


def _prepare(payload: Payload) -> dict[str, Any]:
    """torchrun's contract: device, group, then the kernel's cwd and sys.path, cell as
    __main__."""
    # The worker's own imports (torch, here in a --no-pool worker) come from its own path:
    # the kernel's path may start with its cwd (a Jupyter kernel's, `elastic-magic join`'s).
    _set_device()
    from elastic_magic.worker import default_group

    default_group.keep_destroyed_groups()
    if payload.init_process_group:  # made when the cell first uses it, unless it makes its own
        default_group.arm(payload.backend, payload.timeout)
    else:  # nor one armed by a payload before
        default_group.disarm()
    os.chdir(payload.cwd)
    sys.path[:] = payload.sys_path
    sys.argv = list(payload.argv)
    if payload.session:  # the namespace the session's earlier cells left
        namespace = session.namespace()
    else:
        module = types.ModuleType("__main__")
        module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = module
        namespace = module.__dict__
    for name, module_name in payload.modules.items():
        namespace[name] = importlib.import_module(module_name)
    for name, blob in payload.globals.items():
        namespace[name] = cloudpickle.loads(blob)
    return namespace


def _set_device() -> None:
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)


def shutdown_process_group() -> None:
    """Leave the process group cleanly if the payload (or we) created one; one that was
    armed but never used is not made now."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    from elastic_magic.worker import default_group

    default_group.disarm()
    if dist.is_initialized():
        dist.destroy_process_group()
    else:  # one interrupted while being made (a survivor leaving) left torch's count of
        # group names one ahead: the survivor's next group would wait for new ranks' "0"
        torch_internals.forget_group_names()
    default_group.release_destroyed()


def _execute(payload: Payload, namespace: dict[str, Any]) -> Any:
    if payload.function is not None:
        fn, args, kwargs = cloudpickle.loads(payload.function)
        return fn(*args, **kwargs)
    source = payload.source or ""
    linecache.cache[CELL_FILENAME] = (len(source), None, source.splitlines(True), CELL_FILENAME)
    tree = ast.parse(source, filename=CELL_FILENAME)
    last = None
    if tree.body and isinstance(final := tree.body[-1], ast.Expr):  # the value, as IPython
        tree.body.pop()
        last = ast.Expression(final.value)
    exec(compile(tree, CELL_FILENAME, "exec"), namespace)
    return eval(compile(last, CELL_FILENAME, "eval"), namespace) if last else None


def _encode(value: Any) -> bytes:
    try:
        return cloudpickle.dumps(value)
    except Exception as exc:
        return cloudpickle.dumps(Unpicklable(repr(value)[:500], f"{type(exc).__name__}: {exc}"))


def _result_message(payload: Payload, value: Any, namespace: dict[str, Any]) -> Result:
    pulled: dict[str, bytes] = {}
    missing: list[str] = []
    if int(os.environ.get("RANK", "0")) == 0:
        for name in payload.pull:
            if name in namespace:
                pulled[name] = _encode(namespace[name])
            else:
                missing.append(name)
    return Result(_encode(value), pulled, tuple(missing))


def _user_traceback(exc: BaseException) -> types.TracebackType | None:
    """The traceback from the first frame that is not ours (the cell's, usually); none for
    an interrupt taken in our code (before the cell began: nothing of the user's to show)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(
            (PACKAGE_DIR, contextlib.__file__)):
        tb = tb.tb_next
    return tb if tb is not None or isinstance(exc, KeyboardInterrupt) else exc.__traceback__


def describe_exception(exc: BaseException, exit_code: int) -> ErrorInfo:
    tb = _user_traceback(exc)
    text = "".join(traceback.TracebackException(type(exc), exc, tb).format())
    text = text.replace(f'File "{CELL_FILENAME}", line', "Cell line")
    cell_frames = [f for f in traceback.extract_tb(tb) if f.filename == CELL_FILENAME]
    where = cell_frames[-1] if cell_frames else None
    return ErrorInfo(
        exc_type=type(exc).__qualname__, message=str(exc), traceback=text, time=time.time(),
        exit_code=exit_code, cell_line=where.lineno if where else None,
        source_line=((where.line or "").strip() or None) if where else None,
    )


def why_parked(exc: BaseException) -> tuple[str, bool] | None:
    """Survivors stay: why a rank leaves its payload for the next group on ``exc`` and
    whether that is a failure to report; None when it does not stay (a user's interrupt,
    ``sys.exit``)."""
    if isinstance(exc, ResizeExit):
        return "left at a commit for a resize", False
    if isinstance(exc, KeyboardInterrupt):  # the agent's Interrupt, not a stop (a signal)
        return ("left on the agent's word: the group re-forms", False) if leave.asked() \
            else None
    if isinstance(exc, Exception):  # the agent decides who stays
        return f"failed: {type(exc).__qualname__}", True
    return None


def report_parked(report: AgentClient, exc: BaseException) -> None:
    """The commit being sent is in the agent first (no stale commit reaches the next
    group), the error, if any, is reported, and the rank says it has left its payload."""
    why, failed = why_parked(exc) or ("left", False)
    with contextlib.suppress(BaseException):
        report.drain()
    progress.running.clear()
    metrics_log.flush(report)
    if failed:
        info = describe_exception(exc, 1)
        sys.stderr.write(info.traceback)
        report.send(Failed(info))
    report.send(Parked(why, time.time()))


def leave_group(exc: BaseException | None) -> None:
    """Drop what held the old process group (the failed frames' DDP reducer first), then
    the group."""
    drop_locals(exc)
    del exc
    gc.collect()  # the model, the DDP reducer: what held the old group goes first
    with contextlib.suppress(Exception):  # a group whose peer died may refuse a clean end
        shutdown_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def _park(report: AgentClient, exc: BaseException, namespace: dict[str, Any]) -> None:
    """Survivors stay: leave the payload but not the process. Having said so, while the
    agent forms the next group, the cell's objects (its data loaders' workers too) and the
    process group are dropped, and the rank waits for the next Run, which runs the cell
    from the top."""
    report_parked(report, exc)
    drop_locals(exc)
    del exc
    drop_cell(namespace)


def drop_cell(namespace: dict[str, Any]) -> None:
    namespace.clear()
    leave_group(None)


def _fail(report: AgentClient, exc: BaseException, exit_code: int, leave: bool = True) -> None:
    info = describe_exception(exc, exit_code)
    report_imports(report)
    metrics_log.flush(report)
    if not leave:  # a session's cell: report, drop the frames, wait for the next cell
        with contextlib.suppress(BaseException):  # its last commit, sent or not
            report.drain()
        sys.stderr.write(info.traceback)  # an interrupted cell shows where it was
        progress.running.clear()
        drop_locals(exc)
        session.end_output()
        report.send(Failed(info))
        return
    # A KeyboardInterrupt is the agent stopping the job (Stop, a kernel interrupt, a
    # failure elsewhere): one line per rank, not a traceback of wherever it happened to be.
    stopped = isinstance(exc, KeyboardInterrupt)
    sys.stderr.write("KeyboardInterrupt: stopped\n" if stopped else info.traceback)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if not stopped:  # the commit every rank agreed on lands (the agent waits for it)
            with contextlib.suppress(BaseException):
                report.drain()
        report.send(Failed(info))
    finally:
        # Skip interpreter teardown: it can hang in collectives with peers already gone.
        os._exit(exit_code)
