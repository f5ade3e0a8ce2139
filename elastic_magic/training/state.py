"""Elastic state: what a training must carry across restarts and resizes (``State``).

Snapshots live in the agent (kernel memory, and with ``--checkpoint-dir`` on disk), so a
restarted or resized group starts from the last commit, whatever its new world size. Rank 0
builds the snapshot after every rank has finished the step; model and optimizer states are
identical across ranks under DDP, the sampler's position is global, and the RNG states are
gathered from every rank. Sharded tensors (FSDP2, DTensor) are the exception: each rank
commits its own chunks as its part of the snapshot (``training/sharded.py``).

A commit blocks training only while it copies the state in memory (from a GPU: to the
host); the worker writes and sends the copy on a thread, and the next commit, a restore or
the end of the cell waits for it. A crash meanwhile leaves the commit before whole.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import secrets
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..wire.messages import (
    Commit,
    CommitIntent,
    StateGet,
    StateReply,
)
from ..worker.client import ResizeExit, current
from ..worker.leave import word_deferred
from . import handoff, rng, sharded, snapshot_format
from .collectives import (
    broadcast_flag,
    distributed,
    distributed_unless_alone,
    gather_int,
    gather_ints,
    rank_and_world,
)
from .data import DataLoader, ElasticSampler, samples_seen
from .kept import Kept
from .stateful import GeneratorState, stateful_of

__all__ = ["DataLoader", "ElasticSampler", "State"]

_OWN = ("restored_step",)  # attributes of the State itself, not values
# The State whose commits (or restore) the agent's latest snapshot is: the last one of
# this process to commit or restore (a session may hold an older one, a trainer's too).
_owner: weakref.ref[State] | None = None
_latest: weakref.ref[State] | None = None  # made, committed or restored last


def _at_a_commit(state: State) -> None:
    """``state`` made or restored the agent's latest commit. ``commit(every=N)`` counts from
    it on every rank alike: a survivor rolled back forgets the calls it made past it."""
    global _owner, _latest
    _owner = _latest = weakref.ref(state)
    object.__setattr__(state, "_since_commit", 0)
    object.__setattr__(state, "_last_commit", time.monotonic())


def latest_step() -> Any:
    """The step of this process's latest State (the one made, committed or restored last;
    None without one): where ``elastic_magic.log`` puts its points."""
    state = _latest() if _latest is not None else None
    return None if state is None else state._values.get("step")


def roll_back_kept_states() -> tuple[Any, Any] | None:
    """A session's survivor joining a re-formed group: the State that the agent's latest
    snapshot belongs to goes back to it, as the new ranks restore it (a death in a cell
    left it ahead of that commit). (step before, step now), or None where there is none."""
    state = _owner() if _owner is not None else None
    if state is None:
        return None
    before = state.step
    if not _restore(state, together=False):
        back_to_first_values(state)
    return before, state.step


def first_values_hold(state: State) -> bool:
    """Nothing is committed yet, and the State's large objects are as they were made."""
    first = state._first
    return first is not None and first.holds(first.token, state._objects)


def back_to_first_values(state: State) -> None:
    """Nothing committed yet: a survivor goes back to the first values, where new ranks start."""
    if not first_values_hold(state):
        raise RuntimeError("nothing was committed yet, and the State's large objects have "
                           "changed since it was made")
    state._first.roll_back(state, int(os.environ.get("WORLD_SIZE", "1")))
    _at_a_commit(state)


class State:
    """Stateful objects (restored in place), plain values, RNG states and commits.

    The one rule: an argument with ``state_dict`` and ``load_state_dict`` (a module,
    optimizer, scheduler, GradScaler, AveragedModel, sampler, loader, your own class) or a
    ``torch.Generator`` is an *object*, restored in place, so your variables see the restored
    state. Anything else is a *value* (``state.step``), read and written through the State
    and replaced by the restored one. What can be neither (a generator, an iterator, an open
    file, a socket) is refused (TypeError). In a job, it restores the last commit at once.

    Args:
        model: An object (a DDP or DataParallel wrapper: its module's state is kept).
        optimizer: An object.
        scheduler: An object.
        sampler: An object: an ElasticSampler (or pass ``loader=`` a DataLoader).
        on_resize: ``on_resize(old_world_size, new_world_size)`` runs after a restore from
            a commit made at another world size (Horovod's reset callbacks), e.g. to scale
            the learning rate.
        **values: More objects and values, by name (``step=0``, ``loader=loader``).

    Attributes:
        restored_step: The step the last restore went back to (None: none yet).

    Example:
        >>> state = elastic_magic.State(model=model, optimizer=opt, loader=loader, step=0)
        >>> for batch in loader:  # resumes where the last commit left off
        ...     ...  # one training step
        ...     state.step += 1
        ...     state.commit(every=5)  # every 5th call; a pending resize applies then
    """

    def __init__(self, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                 sampler: Any = None, *, on_resize: Callable[[int, int], Any] | None = None,
                 **values: Any) -> None:
        object.__setattr__(self, "_objects", {})
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_commits", 0)  # commit() calls: the step, if none is given
        object.__setattr__(self, "_since_commit", 0)
        object.__setattr__(self, "_last_commit", time.monotonic())
        object.__setattr__(self, "_on_resize", on_resize)
        object.__setattr__(self, "_staged", None)  # the last commit's copy, once sent
        object.__setattr__(self, "restored_step", None)
        object.__setattr__(self, "_kept", None)  # our own record of the last commit
        object.__setattr__(self, "_first", None)  # its first values, while nothing is committed
        object.__setattr__(self, "_sharded", False)  # holds DTensors: cannot go on in place
        object.__setattr__(self, "_on_reset", [])
        global _latest
        _latest = weakref.ref(self)
        named = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                 "sampler": sampler}
        for name, value in {**named, **values}.items():
            if value is not None or name in values:
                setattr(self, name, value)
        if not self.restore() and current() is not None:
            _first_values(self)

    # state.step, state.epoch, state.model: values and objects read and set as attributes
    def __getattr__(self, name: str) -> Any:
        if name in self._objects:
            obj = self._objects[name]
            return obj.generator if isinstance(obj, GeneratorState) else obj
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"State has no value {name!r}; pass it as State({name}=...)"
                                 ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in _OWN:
            object.__setattr__(self, name, value)
            return
        stateful = stateful_of(name, value)
        if stateful is None:
            self._objects.pop(name, None)
            self._values[name] = value
        else:
            # refuses a layout it cannot restore, now
            if sharded.check(name, stateful):
                object.__setattr__(self, "_sharded", True)
            self._values.pop(name, None)
            self._objects[name] = stateful

    @property
    def step(self) -> Any:
        """The ``step`` value, if given; else the number of ``commit()`` calls. Settable."""
        return self._values.get("step", self._commits)

    @step.setter
    def step(self, value: Any) -> None:
        self._values["step"] = value

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The state now, as this rank alone would commit it (nothing is sent).

        Returns:
            A snapshot that ``load`` restores.
        """
        buffer = io.BytesIO()
        tree, split = _tree(self, [rng.current()], 0)
        snapshot_format.save({**tree, "chunks": split.chunks} if split.sharded else tree,
                             buffer)
        return buffer.getvalue()

    def on_reset(self, callback: Callable[[], Any]) -> Callable[[], Any]:
        """Run ``callback()`` each time ``elastic_magic.run`` goes on in place in a new
        group, after the rollback (Horovod's reset callbacks); usable as a decorator.

        Args:
            callback: Called without arguments.

        Returns:
            ``callback`` itself.
        """
        self._on_reset.append(callback)
        return callback

    def load(self, blob: bytes | Any) -> None:
        """Restore from a snapshot, at any world size (``on_resize`` runs if it differs).

        Args:
            blob: Bytes (``result.snapshot``), or a binary file positioned at its start.

        Raises:
            EOFError: The snapshot is cut short.
        """
        _load(self, io.BytesIO(blob) if isinstance(blob, (bytes, bytearray)) else blob)

    def restore(self) -> bool:
        """Load the agent's latest snapshot on every rank.

        Returns:
            True when there was one (outside a job: False).

        Raises:
            RuntimeError: Ranks received different snapshots, or the commit before failed.
        """
        return _restore(self, together=True)

    def commit(self, *, every: int = 1, seconds: float | None = None) -> bool:
        """Call it on every rank after each (optimizer) step. It snapshots this step in the
        agent on every ``every``-th call, or once ``seconds`` have passed since the last
        commit (rank 0's clock decides, one small broadcast per call); True when it did.
        After a failure the steps since the last commit run again, from the same data and
        random numbers. If a resize is pending, every rank leaves at a commit (by a
        BaseException the worker handles: do not catch it).

        Args:
            every: Commit on every ``every``-th call (1 or more).
            seconds: Also commit once this many seconds have passed since the last commit.

        Returns:
            True when this call committed.

        Raises:
            ValueError: ``every`` is below 1.
            RuntimeError: The agent refused the commit before.
        """
        if every < 1:
            raise ValueError(f"commit(every={every}): give a number of calls, 1 or more")
        object.__setattr__(self, "_commits", self._commits + 1)
        object.__setattr__(self, "_since_commit", self._since_commit + 1)
        client, dist = current(), distributed()
        due = self._since_commit >= every
        if seconds is not None and not due:
            due = time.monotonic() - self._last_commit >= seconds
            if dist is not None:  # every rank must agree, or the collectives below hang
                due = broadcast_flag(dist, due)
        if not due:
            return False
        _at_a_commit(self)
        if client is not None:
            client.drain()  # the commit before is in the agent (or raises why not)
        # every rank's random streams; waits until all finished the step
        rngs = rng.gather(dist) if dist is not None else [rng.current()]
        rank = dist.get_rank() if dist is not None else 0
        dicts = {name: obj.state_dict() for name, obj in self._objects.items()}
        tree, split = _tree(self, rngs, rank, dicts)
        # Replicated (DDP) or one rank: rank 0 has it all. Sharded: a part from each rank.
        part: dict[str, Any] | None = tree if rank == 0 else None
        if split.sharded:
            part = {**(part or {}), "chunks": split.chunks}
        # What blocks training: a copy in memory (from a GPU, to the host); the rest is
        # sent behind it, and the next commit waits for it.
        prepared = snapshot_format.prepare(part, reuse=self._staged) \
            if client is not None and part else None
        object.__setattr__(self, "_staged", prepared)  # its memory serves the next commit
        leave, token, size = False, 0, prepared.nbytes if prepared is not None else 0
        if client is not None and rank == 0:
            leave = client.request(CommitIntent).resize
            token = secrets.randbits(62)
        sizes: tuple[int, ...] = (size,)
        # Once every rank agreed, the agent's word waits until the send has started: a
        # survivor must not hold in memory a commit that the agent never gets.
        with word_deferred():
            if dist is not None:  # every rank leaves, or none; the parts of a commit match
                rows = gather_ints(dist, [int(leave), token, size])
                leave, token = bool(rows[0][0]), rows[0][1]
                sizes = tuple(row[2] for row in rows) if split.sharded else (rows[0][2],)
            if client is not None and not split.sharded:  # to roll back to in place
                object.__setattr__(self, "_kept", Kept.of(token, dicts, self._values,
                                                          self._commits, rngs, rank))
            if client is not None and prepared is not None:
                commit = functools.partial(Commit, step=self.step, time=time.time(),
                                           part=rank, parts=len(sizes), token=token,
                                           sizes=sizes, samples=samples_seen(self._objects))
                client.behind(functools.partial(handoff.send, client, prepared, commit))
        if leave:  # the commit must be whole in the agent before any rank leaves
            if client is not None:
                client.drain()
            if dist is not None:
                gather_int(dist, 0)
            raise ResizeExit(self.step)
        return True


def _first_values(state: State) -> None:
    """Nothing committed yet in this job: a rank that joins starts from this State's first
    values, so a session's survivor goes back to them (``roll_back_kept_states``)."""
    dicts = {name: obj.state_dict() for name, obj in state._objects.items()}
    first = Kept.of(-1, dicts, state._values, 0, [rng.current()], 0)
    object.__setattr__(state, "_first", first)
    _at_a_commit(state)  # as a commit would: the one a survivor goes back to


def _restore(state: State, *, together: bool) -> bool:
    """``restore``; ``together``: every rank, checking they got the same (a collective)."""
    client = current()
    if client is None:
        return False
    # a commit still being sent is the latest (a survivor's that failed in the death
    # that brought it here is none)
    with contextlib.nullcontext() if together else contextlib.suppress(Exception):
        client.drain()
    # A survivor going on in place (elastic_magic.run) rolls back from its memory when
    # what it holds is the agent's latest commit: the agent then sends no snapshot.
    kept = state._kept if state._kept and state._kept.holds(state._kept.token, state._objects) \
        else None
    reply: StateReply = client.request(
        lambda request_id: StateGet(request_id, held=kept.token if kept else 0))
    if kept and reply.token != kept.token:
        kept = None  # a later commit than ours (its copy came with the reply)
    memory_file = None if kept else handoff.open_handoff(reply.handoff)
    if reply.handoff and memory_file is None and not kept:  # cannot read the agent's
        reply = client.request(lambda request_id: StateGet(request_id, inline=True))
    dist = distributed_unless_alone() if together else None
    if dist is not None:  # every rank must start from the same commit
        ids = gather_int(dist, reply.commit_id)
        if len(set(ids)) != 1:
            raise RuntimeError(f"ranks received different snapshots: {ids}")
    if kept:
        kept.roll_back(state, dist.get_world_size() if dist is not None
                       else int(os.environ.get("WORLD_SIZE", "1")))
    elif memory_file is not None:
        with memory_file:
            state.load(memory_file)
    elif reply.snapshot is None:
        return False
    else:
        state.load(reply.snapshot)
    object.__setattr__(state, "restored_step", state.step)
    _at_a_commit(state)
    object.__setattr__(state, "_kept", kept)  # after a load, the objects have changed
    return True


def _tree(state: State, rngs: list[dict[str, Any]], rank: int,
          dicts: dict[str, Any] | None = None) -> tuple[dict[str, Any], sharded.Split]:
    """What a commit of ``state`` saves, DTensors replaced by where they were (rank 0's
    part), and this rank's chunks of them."""
    split = sharded.Split({})
    dicts = dicts or {name: obj.state_dict() for name, obj in state._objects.items()}
    objects = {name: sharded.split(tree, rank, (name,), split)
               for name, tree in dicts.items()}
    values = sharded.split(dict(state._values), rank, ("values",), split)
    object.__setattr__(state, "_sharded", state._sharded or split.sharded)
    return {"values": values, "commits": state._commits, "objects": objects,
            "rngs": rngs, "world_size": len(rngs)}, split


def _load(state: State, source: Any) -> None:
    """Restore ``state`` from the snapshot in the binary file ``source`` (``State.load``)."""
    parts = snapshot_format.SnapshotReader(source)
    data = parts.part(0)
    chunks = sharded.Chunks(parts.part, parts.count)
    state._values.update(sharded.resolve(data["values"], chunks, None, "values"))
    object.__setattr__(state, "_commits", data["commits"])
    saved = data.get("objects") or {n: data[n] for n in
                                    ("model", "optimizer", "scheduler", "sampler")
                                    if n in data}  # snapshots before objects were general
    for name, obj in state._objects.items():
        if name in saved:
            obj.load_state_dict(sharded.resolve(saved[name], chunks, obj, name))
    rank, world = rank_and_world()
    rngs = data.get("rngs") or [data["rng"]]
    rng.apply(rngs[rank % len(rngs)])  # a new rank of a larger group: an old one's
    old_world = data.get("world_size", world)
    if old_world != world and state._on_resize is not None:
        state._on_resize(old_world, world)
