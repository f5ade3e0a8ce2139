"""Every place elastic_magic reaches past torch's public API, and the check that it still can.

elastic_magic uses torch's own rendezvous, process groups and data loader (it uses torch's
rendezvous rather than write one, and skips only its idle waits), and in a few places it
depends on names torch keeps private: to skip the sleeps of a rendezvous round and close it
once every machine linked to the head has joined (``rounds.py`` in this package), to host
each round's worker store itself, to read the number of the round a machine joined, to take
a lost machine out of the rendezvous state at once, to make the default process group on
first use, to spot torch's DataLoader driving an ``ElasticSampler``, and to skip torch's
operator clean-up when a forked worker exits. Each is a small function saying what torch
does there and why we reach in; the rest of the package calls only these
(``tests/test_torch_internals.py`` fails if another module names a private torch name).

Private names move between torch releases without notice. So every one is described by a
:class:`Need` (where it lives, the parameters a function takes, the attributes a method
sets or reads) and checked the first time a function here uses it: on a torch where one
moved or changed, that use raises :class:`UnsupportedTorch`, naming the torch version, the
name, and the torch to install, instead of a worker that hangs or a round that misbehaves.
:func:`check_all` checks every one at once.

Versions: CI installs and tests torch :data:`TESTED_TORCH` (``constraints/ci.txt``). The
package accepts :data:`SUPPORTED_TORCH` (``pyproject.toml``): the versions tests ran on (2.13
in CI, 2.11 on a GPU machine) and those between; every name below was found unchanged (same
parameters, same attributes set and read) in the sources of torch 2.11.0, 2.12.1, 2.13.0 and
2.14.1, and is checked again on whatever torch is installed.
"""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

TESTED_TORCH = "2.13.0"  # constraints/ci.txt
SUPPORTED_TORCH = ">=2.11,<2.14"  # pyproject.toml (a test keeps the two the same)

_RENDEZVOUS = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"


class UnsupportedTorch(RuntimeError):
    """The installed torch lacks (or changed) a private name elastic_magic relies on."""


@dataclass(frozen=True)
class Need:
    """One private part of torch that a function here relies on."""

    module: str
    name: str  # a dotted path inside ``module``
    why: str  # what elastic_magic does with it
    params: tuple[str, ...] | None = None  # a function's parameters, in order
    sets: tuple[str, ...] = ()  # attributes the function assigns (``self.x = ...``)
    reads: tuple[str, ...] = ()  # globals or attributes the function reads
    members: tuple[str, ...] = ()  # attributes a class has (or declares)

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}"


# torch's rendezvous (agent side) -------------------------------------------------------

DELAY = Need(
    _RENDEZVOUS, "_delay", params=("seconds",),
    why="to pace the rendezvous polls and skip the first round's random sleep")
OPERATION_RUN = Need(
    _RENDEZVOUS, "_DistributedRendezvousOpExecutor.run",
    params=("self", "state_handler", "deadline", "update_deadline"),
    sets=("_state",), reads=("_delay",),
    why="to know, while an operation polls, which rendezvous state it last read")
RENDEZVOUS_STATE = Need(
    _RENDEZVOUS, "_RendezvousState",
    members=("round", "complete", "deadline", "closed", "participants", "wait_list",
             "redundancy_list", "last_heartbeats"),
    why="to see a round change while polling, and to take a lost machine out of it")
NODE = Need(
    _RENDEZVOUS, "_NodeDesc", members=("addr", "pid"),
    why="to find a lost machine's node (its address and agent pid) in the state")
STATE_HOLDER = Need(
    _RENDEZVOUS, "_RendezvousStateHolder", members=("state", "sync", "mark_dirty"),
    why="to rewrite the rendezvous state without a lost machine")
HANDLER_STATE = Need(
    _RENDEZVOUS, "DynamicRendezvousHandler.__init__",
    sets=("_state_holder", "_bootstrap_store_info", "_shared_tcp_store_server"),
    why="to reach a handler's state holder and its per-round store bookkeeping")
CREATE_STORE = Need(
    _RENDEZVOUS, "DynamicRendezvousHandler._create_tcp_store_server",
    params=("self", "master_addr", "master_port"),
    why="to host each round's worker store on this machine's address only")
NEXT_ROUND = Need(
    _RENDEZVOUS, "DynamicRendezvousHandler.next_rendezvous",
    reads=("_bootstrap_store_info", "_shared_tcp_store_server", "_create_tcp_store_server"),
    why="to have torch host and publish a fresh worker store every round")
STOP_HEARTBEATS = Need(
    _RENDEZVOUS, "DynamicRendezvousHandler._stop_heartbeats", params=("self",),
    why="to let go of a handler without closing the run id")
REMOVE_EPILOGUE = Need(
    _RENDEZVOUS, "_remove_participant_epilogue", params=("state", "settings"),
    why="to finish taking a lost machine out of the state as torch does for its own")

# torch in the worker -------------------------------------------------------------------

DEFAULT_GROUP = Need(
    "torch.distributed.distributed_c10d", "_get_default_group", reads=("is_initialized",),
    why="to make the job's default process group where the cell first uses it")
MESH_CHECK = Need(
    "torch.distributed.device_mesh", "is_initialized",
    why="to give a DeviceMesh the job's default process group")
GROUP_NAMES = Need(
    "torch.distributed.distributed_c10d", "_process_group_name",
    reads=("_world", "group_count"),
    why="to name a survivor's next default group as new ranks name their first")
LOADER_ITERATOR = Need(
    "torch.utils.data.dataloader", "_BaseDataLoaderIter._reset", reads=("_index_sampler",),
    why="to tell torch's DataLoader iterating an ElasticSampler, which must be refused")
DEL_LIBRARY = Need(
    "torch.library", "_del_library", why="to skip torch's operator clean-up at a worker's exit")
LIBRARY_FINALIZER = Need(
    "torch.library", "Library.__init__", reads=("_del_library",),
    why="to skip torch's operator clean-up at a worker's exit")

NEEDS: tuple[Need, ...]  # more from rounds.py, at the end
NEEDS = (DELAY, OPERATION_RUN, RENDEZVOUS_STATE, NODE, STATE_HOLDER, HANDLER_STATE,
         CREATE_STORE, NEXT_ROUND, STOP_HEARTBEATS, REMOVE_EPILOGUE, DEFAULT_GROUP,
         MESH_CHECK, GROUP_NAMES, LOADER_ITERATOR,
         DEL_LIBRARY, LIBRARY_FINALIZER)


def _unsupported(need: Need, problem: str) -> NoReturn:
    import torch

    raise UnsupportedTorch(
        f"torch {torch.__version__} is not supported by elastic_magic: {need.where} "
        f"{problem}. elastic_magic relies on it {need.why} (elastic_magic/torch_internals/)."
        f" Install a supported torch: pip install 'torch{SUPPORTED_TORCH}' (tested with "
        f"torch {TESTED_TORCH}).")


def _names(function: Any, wanted: tuple[str, ...], stores: bool) -> set[str]:
    """Which of ``wanted`` the function's own code assigns as attributes (``stores``),
    or reads as a global or an attribute."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return set()
    ops = {"STORE_ATTR"} if stores else {"LOAD_ATTR", "LOAD_GLOBAL", "LOAD_METHOD", "LOAD_NAME"}
    return {ins.argval for ins in dis.get_instructions(code)
            if ins.opname in ops and ins.argval in wanted}


def _declares(cls: Any, name: str) -> bool:
    return hasattr(cls, name) or any(
        name in getattr(klass, "__annotations__", {}) for klass in getattr(cls, "__mro__", ()))


def check(need: Need) -> Any:
    """The object ``need`` names, once it is what elastic_magic expects; UnsupportedTorch
    otherwise. (Not cached: functions here use :func:`_get`.)"""
    try:
        found: Any = importlib.import_module(need.module)
    except ImportError as exc:
        _unsupported(need, f"cannot be imported ({exc})")
    for part in need.name.split("."):
        if not hasattr(found, part):
            _unsupported(need, "does not exist in this torch")
        found = getattr(found, part)
    if need.params is not None:
        try:
            params = tuple(inspect.signature(found).parameters)
        except (TypeError, ValueError):
            params = None
        if params != need.params:
            _unsupported(need, f"takes ({', '.join(params or ('?',))}) here, where "
                               f"elastic_magic expects ({', '.join(need.params)})")
    missing = set(need.sets) - _names(found, need.sets, stores=True)
    missing |= set(need.reads) - _names(found, need.reads, stores=False)
    missing |= {name for name in need.members if not _declares(found, name)}
    if missing:
        _unsupported(need, f"no longer uses {', '.join(sorted(missing))}")
    return found


_checked: dict[Need, Any] = {}


def _get(need: Need) -> Any:
    """:func:`check`, once per process."""
    found = _checked.get(need)
    if found is None:
        found = _checked[need] = check(need)
    return found


def check_all() -> None:
    """Check every private name elastic_magic relies on (UnsupportedTorch if one fails)."""
    for need in NEEDS:
        check(need)


# Rendezvous handlers with per-round worker stores (agent/machines/rendezvous.py) ----------------

@functools.cache
def _round_store_handler() -> type[DynamicRendezvousHandler]:
    for need in (HANDLER_STATE, CREATE_STORE, NEXT_ROUND, STOP_HEARTBEATS):
        _get(need)
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    class RoundStoreHandler(DynamicRendezvousHandler):
        """torch's handler, hosting a fresh worker store every round where it would reuse
        the first round's (see :func:`rendezvous_handler`)."""

        host_store: Callable[[str, int], TCPStore]
        worker_store: TCPStore | None = None

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
            self.worker_store = self.host_store(master_addr, master_port)
            return self.worker_store

        def next_rendezvous(self) -> Any:
            self._bootstrap_store_info = None
            self._shared_tcp_store_server = None
            self.worker_store = None
            return super().next_rendezvous()

    return RoundStoreHandler


def rendezvous_handler(host_store: Callable[[str, int], TCPStore],
                       **from_backend: Any) -> DynamicRendezvousHandler:
    """``DynamicRendezvousHandler.from_backend(**from_backend)``, except for the TCPStore
    that node rank 0 hosts each round for the workers' process groups.

    torch makes that store in ``_create_tcp_store_server(master_addr, master_port)``
    (listening on every interface) and publishes its address in the round's store only in
    the first round it hosts one (``_bootstrap_store_info``, ``_shared_tcp_store_server``
    are kept across rounds): a machine joining a later round would wait for it forever,
    and a restarted group would meet a dead group's keys. This handler gets the store
    from ``host_store(addr, port)`` (on our address only) and forgets the last round's
    before each round, so torch hosts and publishes a fresh one every round
    (:func:`round_worker_store`)."""
    handler = _round_store_handler().from_backend(**from_backend)
    handler.host_store = host_store
    return handler


def round_worker_store(handler: DynamicRendezvousHandler) -> TCPStore | None:
    """The worker store ``handler`` hosted for its last round (node rank 0 only; None when
    torch did not host one, as with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``)."""
    return getattr(handler, "worker_store", None)


def release_handler(handler: DynamicRendezvousHandler) -> None:
    """Stop ``handler``'s keep-alive thread (torch's ``_stop_heartbeats``, which its own
    ``shutdown`` calls, but shutdown also closes the run id for every machine) and let go
    of its round's worker store."""
    _get(STOP_HEARTBEATS)(handler)
    handler._shared_tcp_store_server = None
    handler.worker_store = None  # type: ignore[attr-defined]


def rendezvous_round(handler: DynamicRendezvousHandler) -> int:
    """The number of the round ``handler`` last joined: torch prefixes that round's store
    with it, and keeps it only in the state its private state holder
    (``handler._state_holder``) holds. It changes only when a new round completes, which
    this machine must join first."""
    _get(HANDLER_STATE)
    _get(STATE_HOLDER)
    _get(RENDEZVOUS_STATE)
    return int(handler._state_holder.state.round)


def remove_rendezvous_node(handler: DynamicRendezvousHandler, addr: str, pid: int
                           ) -> int | None:
    """Take the machine whose agent runs as ``pid`` on ``addr`` out of the rendezvous
    state (participants, wait list, redundancy list, heartbeats), as torch's state holder
    does once a node's heartbeat expires, and ``_remove_participant_epilogue`` as torch
    runs after a participant leaves (the deadline and the round's completion): the next
    round completes without it at once. Its node rank in the round it took part in, if
    any. Written through ``handler``'s state holder (``handler._state_holder``),
    compare-and-set until it holds; ``handler`` must be one no other thread uses (torch's
    handlers are not thread-safe)."""
    _get(HANDLER_STATE)
    _get(STATE_HOLDER)
    _get(RENDEZVOUS_STATE)
    _get(NODE)
    epilogue = _get(REMOVE_EPILOGUE)
    holder, settings = handler._state_holder, handler.settings
    rank: int | None = None
    while True:
        holder.sync()
        state = holder.state
        gone = {node for node in (*state.participants, *state.wait_list,
                                  *state.redundancy_list, *state.last_heartbeats)
                if node.addr == addr and node.pid == pid}
        if not gone:
            return rank
        for node in gone:
            if node in state.participants and state.complete:
                rank = state.participants[node]
            state.participants.pop(node, None)
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
            state.last_heartbeats.pop(node, None)
        epilogue(state, settings)
        holder.mark_dirty()
        if holder.sync():
            return rank


# The worker's default process group (worker/default_group.py) --------------------------

def route_default_group_checks(is_initialized: Callable[[], bool]) -> None:
    """Point torch's own "is there a default group?" at ``is_initialized``.

    Every use of the default group in torch (get_rank, collectives, DDP, new_group, the
    object collectives) goes through ``distributed_c10d._get_default_group``, which first
    calls ``is_initialized`` from its own module's globals; ``device_mesh`` holds its own
    reference to ``is_initialized`` and calls ``init_process_group()`` when it sees no
    group. Replacing those two globals lets the worker make the job's group at its first
    use; the public ``torch.distributed.is_initialized`` stays torch's."""
    _get(DEFAULT_GROUP)
    _get(MESH_CHECK)
    from torch.distributed import device_mesh
    from torch.distributed import distributed_c10d as c10d

    c10d.is_initialized = device_mesh.is_initialized = is_initialized


def forget_group_names() -> None:
    """Name groups from "0" again, as new ranks do. torch names unnamed groups by a count
    (the default group "0" in a fresh process) and resets it only when it destroys a
    default group: one interrupted while being made (a survivor leaving its payload) leaves
    it one ahead, and the survivor's next group would wait for the new ranks' group "0"."""
    _get(GROUP_NAMES).__globals__["_world"].group_count = 0


# torch's DataLoader (training/data.py) ----------------------------------------------------------

def is_dataloader_iterator(obj: Any) -> bool:
    """Whether ``obj`` is one of torch's DataLoader iterators (single- or multi-process).

    torch's iterators derive from ``torch.utils.data.dataloader._BaseDataLoaderIter``,
    whose ``__init__`` and ``_reset`` call ``iter()`` on the DataLoader's batch sampler
    (``self._index_sampler``): a sampler whose ``__iter__`` finds such an object as the
    caller's ``self`` is being driven by torch's DataLoader, with its prefetching."""
    _get(LOADER_ITERATOR)
    from torch.utils.data import dataloader

    return isinstance(obj, dataloader._BaseDataLoaderIter)


# Forked workers' exit (worker/zygote.py) -----------------------------------------------

def is_library_cleanup(function: Any) -> bool:
    """Whether ``function`` is torch's operator-library clean-up: each
    ``torch.library.Library`` registers ``weakref.finalize(self, _del_library, ...)``,
    which unregisters its operators when the interpreter exits (40-100 ms of every exit,
    for ~130 libraries); the zygote turns those finalizers off for the workers it forks."""
    _get(LIBRARY_FINALIZER)
    return function is _get(DEL_LIBRARY)


# Rendezvous rounds without idle waits (agent/machines/quick_rounds.py): in rounds.py
from . import rendezvous_hooks as rounds  # noqa: E402  (it builds on what is above)

STATE_CACHE: Need = rounds.STATE_CACHE
JOIN_OP: Need = rounds.JOIN_OP
ACTIONS: Need = rounds.ACTIONS
CONTEXT: Need = rounds.CONTEXT
pace_rendezvous_polls, operation_state = rounds.pace_rendezvous_polls, rounds.operation_state
read_state_at_every_poll, completing_join = (rounds.read_state_at_every_poll,
                                             rounds.completing_join)
waiting_rendezvous_nodes = rounds.waiting_rendezvous_nodes
NEEDS += (STATE_CACHE, JOIN_OP, ACTIONS, CONTEXT)

# Collectives refused on a rank that replays setup cells alone (worker/replay_alone.py)
from . import collective_names  # noqa: E402

private_collectives = collective_names.private_collectives
modules_calling_collectives = collective_names.modules_calling_collectives
NEEDS += collective_names.NEEDS
