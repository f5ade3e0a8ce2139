"""Glue to torch's c10d rendezvous, and per-round worker stores.

The rendezvous itself is torch's (DynamicRendezvousHandler over C10dRendezvousBackend, on a
TCPStore hosted here). Worker process groups do NOT share that store: every round gets a
fresh TCPStore, hosted by node rank 0's agent on an OS-assigned port, so a restarted group
can never meet keys left by a dead one (the failure mode of torchrun's shared store).
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousInfo
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

_WORKER_STORE_KEY = "elastic_magic/worker_store"
_LOCAL_SIZE_PREFIX = "elastic_magic/local_world_size/"


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


class _Handler(DynamicRendezvousHandler):
    """torch's handler, except that the store it hosts for agents on node rank 0 (unused
    here: each round gets its own worker store) listens on our host only."""

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        return hosted_store(master_addr, master_port)

    def next_rendezvous(self) -> RendezvousInfo:
        # torch publishes that store's address in a round's store only in the first round
        # it hosts it, so a machine joining a later round waits for it forever. Publish it
        # every round (replacing the store costs little; nothing here uses it).
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return super().next_rendezvous()


@dataclass(frozen=True)
class RoundInfo:
    """This node's place in one completed rendezvous round."""

    round: int
    round_id: str  # the same on every node of this round
    node_rank: int
    nnodes: int
    base_rank: int  # global rank of this node's local rank 0
    world_size: int
    master_addr: str
    master_port: int


class Rendezvous:
    """One job's membership: torch's dynamic rendezvous plus per-round worker stores."""

    def __init__(
        self,
        run_id: str,
        *,
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
        self._nodes = (min_nodes, max_nodes)
        if join is None:
            self.store = hosted_store(host, port)
        else:
            store_host, _, store_port = join.rpartition(":")
            self.store = TCPStore(store_host.strip("[]"), int(store_port), is_master=False,
                                  timeout=timedelta(seconds=60))
        backend = C10dRendezvousBackend(self.store, run_id)
        self.handler = _Handler.from_backend(
            run_id=run_id,
            store=self.store,
            backend=backend,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr=host,
            timeout=RendezvousTimeout(
                join=timedelta(seconds=join_timeout),
                last_call=timedelta(seconds=last_call_timeout),
            ),
        )
        self.rounds = 0
        self._worker_store: TCPStore | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.store.port}"

    def num_nodes_waiting(self) -> int:
        """Machines waiting to join the next round (torch's signal to re-rendezvous)."""
        return self.handler.num_nodes_waiting()

    def next_round(self, local_world_size: int) -> RoundInfo:
        """Join the next round, then agree on ranks and on a fresh worker store."""
        info = self.handler.next_rendezvous()
        self.rounds += 1
        round_store: Store = info.store  # torch prefixes it per round
        node_rank, nnodes = info.rank, info.world_size
        if node_rank == 0:
            self._worker_store = hosted_store(self.host)
            round_store.set(_WORKER_STORE_KEY,
                            f"{uuid.uuid4().hex} {self.host}:{self._worker_store.port}")
        else:
            self._worker_store = None
        round_id, _, address = round_store.get(_WORKER_STORE_KEY).decode().partition(" ")
        addr, _, port = address.rpartition(":")
        # Ranks as torch assigns them: prefix sums of every node's local world size.
        round_store.set(f"{_LOCAL_SIZE_PREFIX}{node_rank}", str(local_world_size))
        sizes = [
            int(v) for v in round_store.multi_get(
                [f"{_LOCAL_SIZE_PREFIX}{r}" for r in range(nnodes)]
            )
        ]
        return RoundInfo(
            round=self.rounds,
            round_id=round_id,
            node_rank=node_rank,
            nnodes=nnodes,
            base_rank=sum(sizes[:node_rank]),
            world_size=sum(sizes),
            master_addr=addr,
            master_port=int(port),
        )

    def cancel(self) -> None:
        """Close the run id from a second handler: a next_round() blocked on another thread
        sees the closed state at its next poll (about a second) and raises. (Handlers are
        not thread-safe: the blocked one must not be touched.)"""
        other = _Handler.from_backend(
            run_id=self.run_id, store=self.store,
            backend=C10dRendezvousBackend(self.store, self.run_id),
            min_nodes=self._nodes[0], max_nodes=self._nodes[1], local_addr=self.host,
        )
        other.shutdown()

    def close(self, shutdown: bool = True) -> None:
        """Stop hosting stores; with ``shutdown``, close the run id for every machine."""
        try:
            if shutdown:
                self.handler.shutdown()
        finally:
            self._worker_store = None
            self.store = None  # type: ignore[assignment]
