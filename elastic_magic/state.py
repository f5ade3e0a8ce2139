"""Elastic state: what a training must carry across restarts and resizes.

    state = elastic_magic.State(model=model, optimizer=opt, sampler=sampler, step=0)
    for indices in sampler:          # resumes where the last commit left off
        ...one training step...
        state.step += 1
        state.commit()               # snapshot to the agent; a pending resize applies here

Snapshots live in the agent (kernel memory, and with ``--checkpoint-dir`` on disk), so a
restarted or resized group starts from the last commit, whatever its new world size. Rank 0
builds the snapshot after every rank has finished the step; model and optimizer states are
identical across ranks under DDP, and the sampler's position is global.
"""

from __future__ import annotations

import io
import os
import random
import time
from collections.abc import Iterator
from typing import Any

from . import snapshot_format
from .messages import Commit, CommitReply, Handoff, StateGet, StateReply
from .worker.client import AgentClient, ResizeExit, current

_STATEFUL = ("model", "optimizer", "scheduler", "sampler")


def _dist() -> Any:
    """torch.distributed when the job has a default group (the automatic one is made
    now if nothing used it yet: State may come before any collective); else None."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from .worker import default_group

    return dist if default_group.ensure() else None


def _unwrap(model: Any) -> Any:
    return getattr(model, "module", model)  # DDP/FSDP-style wrappers keep the model here


class State:
    """Model, optimizer, LR scheduler, sampler position, RNG states and plain values."""

    def __init__(self, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                 sampler: Any = None, **values: Any) -> None:
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                   "sampler": sampler}
        object.__setattr__(self, "_objects", {k: v for k, v in objects.items()
                                               if v is not None})
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "restored_step", None)
        self.restore()

    # plain values read and written as attributes: state.step, state.epoch
    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"State has no value {name!r}; pass it as State({name}=...)"
                                 ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _STATEFUL or name.startswith("_") or name == "restored_step":
            object.__setattr__(self, name, value)
        else:
            self._values[name] = value

    @property
    def step(self) -> Any:
        return self._values.get("step", self._commits)

    @step.setter
    def step(self, value: Any) -> None:
        self._values["step"] = value

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self) -> bytes:
        buffer = io.BytesIO()
        self._save(buffer)
        return buffer.getvalue()

    def _save(self, file: Any) -> None:
        import torch

        data: dict[str, Any] = {"values": dict(self._values), "commits": self._commits}
        for name, obj in self._objects.items():
            data[name] = (_unwrap(obj) if name == "model" else obj).state_dict()
        data["rng"] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            data["rng"]["cuda"] = torch.cuda.get_rng_state()  # this rank's device (dropout)
        try:
            import numpy

            data["rng"]["numpy"] = numpy.random.get_state()
        except ImportError:
            pass
        snapshot_format.save(data, file)

    def load(self, blob: bytes | Any) -> None:
        """Restore from a snapshot: bytes, or a binary file positioned at its start."""
        import torch

        source = io.BytesIO(blob) if isinstance(blob, (bytes, bytearray)) else blob
        data = snapshot_format.load(source)
        self._values.update(data["values"])
        object.__setattr__(self, "_commits", data["commits"])
        for name, obj in self._objects.items():
            if name in data:
                (_unwrap(obj) if name == "model" else obj).load_state_dict(data[name])
        random.setstate(data["rng"]["python"])
        torch.set_rng_state(data["rng"]["torch"])
        if "cuda" in data["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(data["rng"]["cuda"])
        if "numpy" in data["rng"]:
            import numpy

            numpy.random.set_state(data["rng"]["numpy"])

    def restore(self) -> bool:
        """Load the agent's latest snapshot on every rank; True when there was one."""
        client = current()
        if client is None:
            return False
        reply: StateReply = client.request(StateGet)
        memory_file = _open_handoff(reply.handoff)
        if reply.handoff and memory_file is None:  # cannot read the agent's file
            reply = client.request(lambda request_id: StateGet(request_id, inline=True))
        dist = _dist()
        if dist is not None:  # every rank must start from the same commit
            ids = [None] * dist.get_world_size()
            dist.all_gather_object(ids, reply.commit_id)
            if len(set(ids)) != 1:
                raise RuntimeError(f"ranks received different snapshots: {ids}")
        if memory_file is not None:
            with memory_file:
                self.load(memory_file)
        elif reply.snapshot is None:
            return False
        else:
            self.load(reply.snapshot)
        object.__setattr__(self, "restored_step", self.step)
        return True

    def commit(self) -> None:
        """Snapshot this step in the agent. Call it on every rank after the step; if a
        resize is pending, every rank then leaves and the job goes on at the new size."""
        object.__setattr__(self, "_commits", self._commits + 1)
        client, dist = current(), _dist()
        if dist is not None:
            dist.barrier()  # every rank has finished the step
        resize = False
        if client is not None and (dist is None or dist.get_rank() == 0):
            resize = self._send_snapshot(client)
        if dist is not None:
            flag = [resize]
            dist.broadcast_object_list(flag, src=0)
            resize = flag[0]
        if resize:
            raise ResizeExit(self.step)


    def _send_snapshot(self, client: AgentClient) -> bool:
        """Commit this snapshot in the agent; True when every rank must leave for a resize.

        A large snapshot is dominated by copies, so it is written once, into an anonymous
        memory file that the agent reads through /proc; where that is not possible, it goes
        down the pipe."""
        global _HANDOFF
        step, now = self.step, time.time()
        reply: CommitReply
        if _HANDOFF:
            fd = os.memfd_create("elastic-snapshot", os.MFD_CLOEXEC)
            try:
                with os.fdopen(fd, "wb", closefd=False) as file:
                    self._save(file)
                offer = Handoff.of(fd)
                reply = client.request(lambda request_id: Commit(request_id, step, now,
                                                                 handoff=offer))
            finally:
                os.close(fd)
            if not reply.handoff_failed:
                return reply.resize
            _HANDOFF = False  # the agent cannot read our memory files: use the pipe
        blob = self.snapshot()
        reply = client.request(lambda request_id: Commit(request_id, step, now, snapshot=blob))
        return reply.resize


_HANDOFF = hasattr(os, "memfd_create")


def _open_handoff(offer: Handoff | None) -> Any:
    """The agent's memory file holding the snapshot, opened through /proc; None if there
    is none or it cannot be opened."""
    if offer is None:
        return None
    try:
        return open(offer.path, "rb")
    except OSError:
        return None


class ElasticSampler:
    """Deterministic, resumable batches whose order does not depend on the world size.

    Each epoch is one permutation of ``range(length)`` (seeded by ``seed + epoch``), cut
    into global batches of ``global_batch_size``; rank r of w takes the r-th of w equal
    slices of each global batch. Iterating yields this rank's indices for the remaining
    global batches of the epoch; ``state_dict`` records (epoch, position), so a group of
    any size resumes at the next global batch. The last incomplete batch is dropped.
    """

    def __init__(self, length: int, global_batch_size: int, *, seed: int = 0,
                 shuffle: bool = True) -> None:
        if global_batch_size < 1 or length < global_batch_size:
            raise ValueError(f"global_batch_size {global_batch_size} must be between 1 and "
                             f"the dataset length {length}")
        self.length = length
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # global batches of this epoch already handed out

    def __len__(self) -> int:
        return self.length // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def _order(self) -> list[int]:
        import torch

        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        dist = _dist()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
        if self.global_batch_size % world:
            raise ValueError(
                f"global batch {self.global_batch_size} cannot be split evenly across "
                f"{world} ranks; pick a global batch size divisible by every world size")
        local = self.global_batch_size // world
        order = self._order()
        while self.position < len(self):
            start = self.position * self.global_batch_size + rank * local
            self.position += 1  # counted when handed out; a commit after the step keeps it
            yield order[start:start + local]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
