"""Glue to torch's c10d rendezvous, and per-round worker stores.

The rendezvous itself is torch's (DynamicRendezvousHandler over C10dRendezvousBackend, on a
TCPStore hosted here). Worker process groups do NOT share that store: every round gets a
fresh TCPStore, hosted by node rank 0's agent on an OS-assigned port, so a restarted group
can never meet keys left by a dead one (the failure mode of torchrun's shared store).

Everything read from the rendezvous store is signed with the job's key and verified first
(``signed.py``). When the head knows that a machine is gone (its link closed, or stopped
carrying heartbeats), :meth:`Rendezvous.remove_node` takes it out of torch's state at once,
as torch's own expiry of its heartbeat would some 15 s later. A round the head waits in
closes as soon as every machine linked to it has joined, not when the round's last call
ends (:meth:`Rendezvous.close_rounds_when_joined`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from ... import torch_internals
from ..round_info import RoundInfo
from . import quick_rounds  # torch's idle waits, skipped (installed on import)
from .signed import (
    RendezvousRejected,
    SignedBackend,
    get_signed,
    put_signed,
    rendezvous_key,
)

_T = TypeVar("_T")

__all__ = ["Rendezvous", "RendezvousRejected", "SignedBackend", "get_signed",
           "hosted_store", "put_signed", "rendezvous_key"]

_WORKER_STORE_KEY = "elastic_magic/worker_store"
_LOCAL_SIZE_PREFIX = "elastic_magic/local_world_size/"


def agent_name(host: str, pid: int) -> str:
    """A machine as its agent: several may share an address (one machine rehearsing)."""
    return f"{host} (pid {pid})"


def _size_and_agent(value: str, node_rank: int) -> tuple[int, str, int]:
    """A machine's "SIZE HOST PID" (its agent as torch knows it); a value without the agent
    (an older elastic_magic) is named by its node rank."""
    size, _, agent = value.partition(" ")
    host, _, pid = agent.rpartition(" ")
    if not pid.isdigit():
        return int(size), f"node {node_rank}", 0
    return int(size), host, int(pid)


def hosted_store(host: str, port: int = 0, timeout: float = 60.0) -> TCPStore:
    """A TCPStore server listening on ``host`` only. Given a bare port, torch listens on
    every interface; a socket we bind ourselves keeps a standalone job on loopback.
    Port 0: the OS picks a free port at bind time (never pick-then-bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        bound_port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store owns the descriptor from here on and closes it when it is destroyed.
    return TCPStore(host, bound_port, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout), master_listen_fd=sock.detach())


class Rendezvous:
    """One job's membership: torch's dynamic rendezvous plus per-round worker stores, with
    everything read from the store verified against ``key``."""

    def __init__(
        self,
        run_id: str,
        *,
        key: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        join: str | None = None,
        min_nodes: int = 1,
        max_nodes: int = 1,
        join_timeout: float = 600.0,
        last_call_timeout: float = 1.0,
    ) -> None:
        """Host the rendezvous store on ``host:port``, or with ``join`` ("HOST:PORT") use
        the store another machine hosts; ``host`` is then this machine's own address."""
        self.run_id = run_id
        self.host = host
        self.key = key
        self._nodes = (min_nodes, max_nodes)
        self._timeout = RendezvousTimeout(join=timedelta(seconds=join_timeout),
                                          last_call=timedelta(seconds=last_call_timeout))
        # The first value that failed verification, on whichever thread read it.
        self.rejected: RendezvousRejected | None = None
        # Only this object holds the server, and torch's handler talks to it as a client:
        # close() then closes its port even while something (a traceback's frames, say)
        # still holds the handler.
        self._server: TCPStore | None = None
        if join is None:
            self._server = hosted_store(host, port)
            self._where = f"{host}:{self._server.port}"
        else:
            self._where = join
        store_host, _, store_port = self._where.rpartition(":")
        self.store: TCPStore | None = TCPStore(store_host.strip("[]"), int(store_port),
                                               is_master=False, timeout=timedelta(seconds=60))
        self.handler: DynamicRendezvousHandler | None = self._new_handler(self.store)
        self.rounds = 0
        self.sizes: list[int] = []  # every node's local world size in the last round
        # How a round's machines are named (RoundInfo.machines): the head's own words for
        # the machines that joined it (``Launched.label``).
        self.name_machine: Callable[[str, int], str] = agent_name
        self._worker_store: TCPStore | None = None
        self._ready: quick_rounds.Ready | None = None  # may this machine close a round

    def _new_handler(self, store: TCPStore) -> DynamicRendezvousHandler:
        """torch's handler, hosting each round's worker store on our host only (on node
        rank 0), a fresh one every round."""
        backend = SignedBackend(store, self.run_id, self.key, self._where, self._note)
        handler = torch_internals.rendezvous_handler(
            hosted_store, run_id=self.run_id, store=store, backend=backend,
            min_nodes=self._nodes[0], max_nodes=self._nodes[1], local_addr=self.host,
            timeout=self._timeout)
        quick_rounds.quicken(handler)
        return handler

    def close_rounds_when_joined(self, expected: Callable[[], set[tuple[str, int]] | None]
                                 ) -> None:
        """A round this machine waits in closes as soon as it has MIN machines and every
        machine ``expected()`` names (address, agent pid) has joined it, instead of
        waiting out the last call; None from ``expected``: not known yet (a machine is
        still saying who it is), so torch's last call decides. ``expected`` is asked on
        the thread that joins the round, at each poll while the last call runs."""
        def ready(joined: set[tuple[str, int]]) -> bool:
            machines = expected()
            return machines is not None and machines <= joined

        self._ready = ready

    def _note(self, error: RendezvousRejected) -> None:
        if self.rejected is None:  # a copy: the one raised will carry frames that hold stores
            self.rejected = RendezvousRejected(str(error))

    def _live(self) -> tuple[TCPStore, DynamicRendezvousHandler]:
        if self.store is None or self.handler is None:
            raise RuntimeError("the rendezvous is closed")
        return self.store, self.handler

    @property
    def endpoint(self) -> str:
        return self._where

    def check(self) -> None:
        """Raise if anything read from the store failed verification. torch's heartbeat
        thread reads the state too, and only logs what goes wrong there."""
        if self.rejected is not None:
            raise RendezvousRejected(str(self.rejected))

    def publish(self, name: str, value: str) -> None:
        """A signed job-wide value (machines that join read it with ``get_signed``)."""
        store, _ = self._live()
        put_signed(store, self.key, name, value)

    def num_nodes_waiting(self) -> int:
        """Machines waiting to join the next round (torch's signal to re-rendezvous)."""
        return self._live()[1].num_nodes_waiting()

    def next_round(self, local_world_size: int) -> RoundInfo:
        """Join the next round, then agree on ranks and on a fresh worker store."""
        _, handler = self._live()
        with quick_rounds.closing(self._ready):
            info = handler.next_rendezvous()
        self.rounds += 1
        round_store: Store = info.store  # torch prefixes it per round
        node_rank, nnodes = info.rank, info.world_size
        # Signed for this round of this run: a value copied from an earlier round (an old
        # store's address, on a port someone else may hold now) is refused.
        scope = f"{self.run_id}/{torch_internals.rendezvous_round(handler)}"
        if node_rank == 0:
            # torch hosted it for this round (unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE).
            self._worker_store = (torch_internals.round_worker_store(handler)
                                  or hosted_store(self.host))
            put_signed(round_store, self.key, _WORKER_STORE_KEY,
                       f"{uuid.uuid4().hex} {self.host}:{self._worker_store.port}",
                       scope=scope)
        else:
            self._worker_store = None
        round_id, _, address = get_signed(round_store, self.key, _WORKER_STORE_KEY,
                                          self._where, scope=scope).partition(" ")
        addr, _, port = address.rpartition(":")
        # Ranks as torch assigns them: prefix sums of every node's local world size, each
        # told with the machine's agent as torch knows it (address, pid): its name.
        # Signed for this round only: another round's sizes are refused.
        put_signed(round_store, self.key, f"{_LOCAL_SIZE_PREFIX}{node_rank}",
                   f"{local_world_size} {self.host} {os.getpid()}", scope=round_id)
        told = [_size_and_agent(get_signed(round_store, self.key, f"{_LOCAL_SIZE_PREFIX}{r}",
                                           self._where, scope=round_id), r)
                for r in range(nnodes)]
        sizes = self.sizes = [size for size, _, _ in told]
        return RoundInfo(
            round=self.rounds,
            round_id=round_id,
            node_rank=node_rank,
            nnodes=nnodes,
            base_rank=sum(sizes[:node_rank]),
            world_size=sum(sizes),
            master_addr=addr,
            master_port=int(port),
            machines=tuple((self.name_machine(host, pid) if pid else host, size)
                           for size, host, pid in told),
        )

    def next_round_unless(self, local_world_size: int, stop: Callable[[], bool],
                          interval: float, *, cancel: bool) -> RoundInfo | None:
        """``next_round`` on a helper thread (machines may be awaited for long), asking
        ``stop()`` every ``interval`` seconds meanwhile. On a stop: None, after closing the
        run id for every machine when ``cancel`` (the machine hosting the job). Errors of
        the round are raised here. A stop already due (a machine given back at a commit)
        joins no round: once joined, the others would wait for this machine."""
        outcome: queue.Queue[tuple[RoundInfo | None, BaseException | None]] = queue.Queue()
        if stop():
            if cancel:
                with contextlib.suppress(Exception):
                    self.cancel()
            return None

        def join() -> None:
            try:
                outcome.put((self.next_round(local_world_size), None))
            except BaseException as exc:
                outcome.put((None, exc))

        helper = threading.Thread(target=join, name=f"elastic-rendezvous-{self.run_id}",
                                  daemon=True)
        helper.start()
        while True:
            try:
                info, error = outcome.get(timeout=interval)
                break
            except queue.Empty:
                if stop():
                    if cancel:
                        # A stop always stops: if the state cannot even be closed (it was
                        # forged, say), the job still ends and its store is released.
                        with contextlib.suppress(Exception):
                            self.cancel()
                        helper.join(timeout=10)
                    return None
        if error is not None:
            raise error
        return info

    def remove_node(self, addr: str, pid: int) -> int | None:
        """Take the machine whose agent runs as ``pid`` on ``addr`` out of torch's state
        (participants, wait list, redundancy list, heartbeats), as torch's sanitizer does
        once a heartbeat expires: the next round completes without it at once. Its node
        rank in the round it took part in, if any. Written through a second handler's
        state holder (handlers are not thread-safe), compare-and-set until it holds."""
        return self._on_second_handler(
            lambda other: torch_internals.remove_rendezvous_node(other, addr, pid))

    def waiting_agents(self) -> set[tuple[str, int]]:
        """The machines waiting for the next round, as (address, agent pid): read through
        a second handler's state holder (handlers are not thread-safe)."""
        return self._on_second_handler(torch_internals.waiting_rendezvous_nodes)

    def cancel(self) -> None:
        """Close the run id from a second handler: a next_round() blocked on another thread
        sees the closed state at its next poll (within a quarter second: quick_rounds) and
        raises. (Handlers are not thread-safe: the blocked one must not be touched.)"""
        self._on_second_handler(lambda other: other.shutdown())

    def _on_second_handler(self, act: Callable[[DynamicRendezvousHandler], _T]) -> _T:
        """``act`` on a handler of our own over the same store, let go after (without
        closing the run id): the main handler may be in use on another thread."""
        other = self._new_handler(self._live()[0])
        try:
            return act(other)
        finally:
            torch_internals.release_handler(other)

    def close(self, shutdown: bool = True) -> None:
        """Stop hosting stores; with ``shutdown``, close the run id for every machine. Each
        step runs even when one before it raised: the stores' ports close whatever
        happened to the run id."""
        handler, self.handler = self.handler, None
        try:
            if handler is not None:
                try:
                    if shutdown:
                        handler.shutdown()
                finally:
                    torch_internals.release_handler(handler)
        finally:
            self._worker_store = None
            self.store = None
            self._server = None
