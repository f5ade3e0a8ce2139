"""A completed rendezvous round as this machine sees it: what the rendezvous
(``machines/rendezvous.py``) hands the loop, and what this machine's workers are started
with (``node/workers.py``)."""

from __future__ import annotations

from dataclasses import dataclass


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
    # every node's (name, local world size), in node rank order
    machines: tuple[tuple[str, int], ...] = ()
