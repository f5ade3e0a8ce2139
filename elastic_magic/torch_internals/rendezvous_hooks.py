"""torch's rendezvous rounds without idle waits (``agent/machines/quick_rounds.py``): its
polls paced, its state read at every poll, and a round closed once every machine the head
waits for has joined. Part of ``torch_internals``: the same rules (every private name a
:class:`Need`, checked before use). The names behind the early close and the uncached state
(STATE_CACHE, JOIN_OP, ACTIONS, CONTEXT) were read in torch 2.13.0's sources only; on
another torch their checks say whether they still hold."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import (
    _RENDEZVOUS,
    DELAY,
    HANDLER_STATE,
    NODE,
    OPERATION_RUN,
    RENDEZVOUS_STATE,
    STATE_HOLDER,
    Need,
    _get,
)

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

STATE_CACHE: Need = Need(
    _RENDEZVOUS, "_BackendRendezvousStateHolder.sync", reads=("_cache_duration",),
    why="to read the rendezvous state at every poll, not a copy up to a second old")
JOIN_OP: Need = Need(
    _RENDEZVOUS, "_RendezvousJoinOp.__call__", params=("self", "ctx", "deadline"),
    why="to close a round as soon as every machine linked to the head has joined it")
ACTIONS: Need = Need(
    _RENDEZVOUS, "_Action", members=("SYNC", "MARK_RENDEZVOUS_COMPLETE"),
    why="to close a round as soon as every machine linked to the head has joined it")
CONTEXT: Need = Need(
    _RENDEZVOUS, "_RendezvousContext.__init__", sets=("node", "state", "settings"),
    why="to see, in a join operation, the node it runs for and the round's state")

_poll_hooks: tuple[Callable[..., None], Callable[..., None]] | None = None


def pace_rendezvous_polls(
    delay: Callable[[float | tuple[float, float]], None], run: Callable[..., None]
) -> tuple[Callable[[float | tuple[float, float]], None], Callable[..., None]]:
    """Install ``delay`` and ``run`` in torch's rendezvous; torch's own two are returned.

    torch's rendezvous sleeps through ``dynamic_rendezvous._delay(seconds)``, a module
    global: a random 0-0.3 s before a handler's first round, and 1 s between the polls of
    an operation (join, leave, close) that waits for other machines. Those polls run inside
    ``_DistributedRendezvousOpExecutor.run``, which keeps the state it last read in
    ``self._state`` (see :func:`operation_state`). ``delay`` replaces the global;
    ``run(executor, *args, **kwargs)`` replaces the method and must call torch's. Once per
    process (a second call with the same pair returns torch's two again)."""
    global _poll_hooks
    module: Any = importlib.import_module(_RENDEZVOUS)
    if _poll_hooks is not None:
        if (module._delay, module._DistributedRendezvousOpExecutor.run) != (delay, run):
            raise RuntimeError("torch's rendezvous polls are already paced by others")
        return _poll_hooks
    torch_delay, torch_run = _get(DELAY), _get(OPERATION_RUN)
    # inspect.signature and the checks above see torch's own through the replacements.
    functools.update_wrapper(delay, torch_delay, assigned=(), updated=())
    functools.update_wrapper(run, torch_run, assigned=(), updated=())
    module._delay = delay
    module._DistributedRendezvousOpExecutor.run = run
    _poll_hooks = (torch_delay, torch_run)
    return _poll_hooks


def operation_state(executor: Any) -> Any:
    """The rendezvous state (``_RendezvousState``: round, complete, closed, deadline,
    participants, wait_list) that the operation ``executor`` runs last read: torch keeps
    it in ``executor._state``, refreshed at every poll."""
    _get(OPERATION_RUN)
    _get(RENDEZVOUS_STATE)
    return executor._state


def read_state_at_every_poll(handler: DynamicRendezvousHandler) -> None:
    """Have ``handler`` read the shared rendezvous state at every poll of an operation.

    torch's state holder (``handler._state_holder``, a ``_BackendRendezvousStateHolder``)
    answers a read with the copy it synced last while that copy is younger than its
    ``_cache_duration`` (1 s, which ``from_backend`` does not let a caller set): a node
    waiting in a round saw another machine join, or the round complete, up to a second
    late, whatever the pace of its polls. Writes were never cached."""
    _get(HANDLER_STATE)
    _get(STATE_CACHE)
    handler._state_holder._cache_duration = 0  # type: ignore[attr-defined]


def completing_join(operation: Any, complete: Callable[[Any], bool]) -> Any:
    """``operation`` (what an executor runs), unchanged unless it is torch's join
    (``_RendezvousJoinOp``): then one that may close the round early.

    torch's join returns ``_Action.SYNC`` (poll again) while its node waits, in particular
    while it is a participant of a round that has MIN machines but not MAX and whose last
    call (``state.deadline``) has not passed; then ``_Action.MARK_RENDEZVOUS_COMPLETE``,
    and the executor completes the round (ranks in sorted order, written compare-and-set:
    when another machine changed the state meanwhile, the write fails and the operation
    looks again). Here that action comes where torch's would be SYNC and ``complete(ctx)``
    says yes (``ctx``: the node, the state it read, the settings)."""
    module: Any = importlib.import_module(_RENDEZVOUS)
    for need in (JOIN_OP, ACTIONS, CONTEXT):
        _get(need)
    if not isinstance(operation, module._RendezvousJoinOp):
        return operation
    sync, close = module._Action.SYNC, module._Action.MARK_RENDEZVOUS_COMPLETE

    def join(ctx: Any, deadline: float) -> Any:
        action = operation(ctx, deadline)
        return close if action is sync and complete(ctx) else action

    return join


def waiting_rendezvous_nodes(handler: DynamicRendezvousHandler) -> set[tuple[str, int]]:
    """The machines in the rendezvous state's wait list, as (address, agent pid): those
    ``num_nodes_waiting`` counts, which is all torch tells. Read through ``handler``'s
    state holder after a sync; ``handler`` must be one no other thread uses."""
    _get(HANDLER_STATE)
    _get(STATE_HOLDER)
    _get(RENDEZVOUS_STATE)
    _get(NODE)
    holder = handler._state_holder
    holder.sync()
    return {(node.addr, node.pid) for node in holder.state.wait_list}
