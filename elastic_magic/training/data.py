"""Resumable data order: ``ElasticSampler`` and the ``DataLoader`` that feeds it.

The sampler's position is counted in samples of the epoch, summed over every rank, so a
group of any size resumes at the next unseen sample. A commit must record the batches the
loop has *consumed*; a torch DataLoader with worker processes asks its sampler for several
batches ahead of the loop, so the position is kept by ``elastic_magic.DataLoader``, which
moves it as the loop receives each batch, whatever is prefetched behind it.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data as tud

from .. import torch_internals
from .collectives import rank_and_world


class ElasticSampler:
    """Deterministic, resumable batches (a ``batch_sampler``), exact across world sizes.

    Each epoch is one permutation of ``range(length)`` (seeded by ``seed + epoch``, the
    order ``DistributedSampler`` uses), cut into global batches; rank r of w takes the r-th
    of w equal slices of each. Two semantics:

    - ``ElasticSampler(n, global_batch_size=G)``: a fixed global batch of G, G/w per rank
      (the arithmetic of a step does not depend on the world size);
    - ``ElasticSampler(n, batch_size=b)``: a fixed per-rank batch, a global batch of b*w
      (Horovod's; scale the learning rate with ``State(on_resize=...)``).

    The last incomplete global batch is dropped (``drop_last=True``) or filled up from the
    start of the epoch's order (``drop_last=False``, as DistributedSampler pads).
    ``state_dict`` records (epoch, offset): the samples of the epoch consumed by all ranks.
    Iterate it directly (``for indices in sampler``, position counted when handed out), or
    through ``elastic_magic.DataLoader`` (counted when the loop receives the batch); a torch
    DataLoader is refused (TypeError at its first batch).

    Args:
        length: The dataset's length.
        global_batch_size: A fixed global batch, split evenly across the ranks.
        batch_size: A fixed per-rank batch (give this or ``global_batch_size``).
        seed: The shuffle's seed (each epoch's is ``seed + epoch``).
        shuffle: Permute each epoch; False: in index order.
        drop_last: Drop the last incomplete global batch; False: fill it up.

    Attributes:
        epoch: The epoch it hands out (``set_epoch``).
        offset: Samples of this epoch consumed, all ranks together.

    Raises:
        ValueError: Both or neither batch size, or one outside 1..``length``.

    Example:
        >>> sampler = ElasticSampler(len(dataset), global_batch_size=64)
        >>> loader = elastic_magic.DataLoader(dataset, batch_sampler=sampler)
    """

    def __init__(self, length: int, global_batch_size: int | None = None, *,
                 batch_size: int | None = None, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        if (global_batch_size is None) == (batch_size is None):
            raise ValueError("give ElasticSampler either global_batch_size (fixed global batch)"
                             " or batch_size (fixed per-rank batch), not both")
        size = global_batch_size or batch_size or 0
        if size < 1 or length < size:
            raise ValueError(f"batch size {size} must be between 1 and the dataset length "
                             f"{length}")
        self.length = length
        self.global_batch_size = global_batch_size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0  # samples of this epoch consumed, all ranks together
        self._finished_here = False  # this process iterated the epoch to its end

    def split(self, world: int) -> tuple[int, int]:
        """The batch sizes at a world size.

        Args:
            world: The number of ranks.

        Returns:
            (this rank's batch, the global batch).

        Raises:
            ValueError: The global batch does not split evenly into ``world`` ranks.
        """
        if self.batch_size is not None:
            return self.batch_size, self.batch_size * world
        assert self.global_batch_size is not None
        if self.global_batch_size % world:
            raise ValueError(
                f"global batch {self.global_batch_size} cannot be split evenly across "
                f"{world} ranks; pick a global batch size divisible by every world size")
        return self.global_batch_size // world, self.global_batch_size

    def __len__(self) -> int:
        """Batches per rank in a whole epoch at the current world size."""
        step = self.split(rank_and_world()[1])[1]
        return self.length // step if self.drop_last else -(-self.length // step)

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``, as ``DistributedSampler.set_epoch`` (call it before
        each epoch; the same epoch again keeps the position, as after a restore).

        Args:
            epoch: The epoch to hand out.
        """
        if epoch != self.epoch:
            self.epoch, self.offset, self._finished_here = epoch, 0, False

    @property
    def samples_seen(self) -> int:
        """Samples handed out since epoch 0, all ranks together (whole epochs counted as
        the dataset's length): what a commit tells for the samples/s chart."""
        return self.epoch * self.length + self.offset

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        if torch_internals.is_dataloader_iterator(sys._getframe(1).f_locals.get("self")):
            return _refuse_torch_dataloader()
        return self._batches(None)

    def _batches(self, handed_out: deque[int] | None) -> Iterator[list[int]]:
        """This rank's remaining batches. Each batch's end offset goes to ``handed_out``
        (a DataLoader records it when the loop receives the batch); without one, the
        position moves as each batch is handed out."""
        if self._finished_here:
            raise RuntimeError(
                f"epoch {self.epoch} of this ElasticSampler is finished; call "
                "sampler.set_epoch(epoch) before each epoch, as with DistributedSampler")
        rank, world = rank_and_world()
        local, step = self.split(world)
        order, offset = self._order(), self.offset
        last = self.length - step if self.drop_last else self.length - 1
        while offset <= last:
            batch = order[offset:offset + step]
            if len(batch) < step:  # pad the last global batch from the start of the order
                batch += list(itertools.islice(itertools.cycle(order), step - len(batch)))
            offset = min(offset + step, self.length)
            mine = batch[rank * local:(rank + 1) * local]
            if handed_out is None:
                self.offset = offset  # the loop trains on it; the commit after the step keeps it
                yield mine
            else:
                handed_out.append(offset)
                yield _Batch(mine, seed=(self.seed * 1_000_003 + self.epoch) % 2**62)
        if handed_out is None:
            self._finished_here = True

    def state_dict(self) -> dict[str, int]:
        """The position, for State's commits.

        Returns:
            ``{"epoch": ..., "offset": ...}``: the samples of the epoch all ranks consumed.
        """
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Go back to a position (``state_dict``'s), at any world size.

        Args:
            state: What ``state_dict`` returned.
        """
        self.epoch, self._finished_here = state["epoch"], False
        if "offset" in state:
            self.offset = state["offset"]
        else:  # snapshots before offsets counted global batches
            self.offset = state["position"] * (self.global_batch_size or 0)


def samples_seen(objects: dict[str, Any]) -> int | None:
    """The data position's samples so far, where a State's objects hold an ElasticSampler
    (or a loader made with one)."""
    for obj in objects.values():
        sampler = obj if isinstance(obj, ElasticSampler) else getattr(obj, "elastic_sampler",
                                                                       None)
        if isinstance(sampler, ElasticSampler):
            return sampler.samples_seen
    return None


def _refuse_torch_dataloader() -> Iterator[list[int]]:
    """A torch DataLoader pulls batches from its sampler ahead of the loop (worker
    prefetch) and draws its worker seed from the global RNG: its commits would record
    batches the loop never trained on. (Raised at the first batch, once torch's iterator
    is whole enough to clean up after itself.)"""
    raise TypeError(
        "ElasticSampler in a torch DataLoader would record the batches the DataLoader "
        "prefetched, not the ones the loop trained on; use elastic_magic.DataLoader "
        "(same arguments) instead of torch.utils.data.DataLoader")
    yield []


class _Batch(list[int]):
    """This rank's indices of one batch, with the seed of the epoch's random draws."""

    def __init__(self, indices: list[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed


def _seed_everything(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # torch.manual_seed also seeds CUDA: 40x slower
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)


class _SeededDataset(tud.Dataset[Any]):
    """The user's dataset as the loader fetches it. In a worker process, each sample's
    random draws (augmentations) start from a seed of (seed, epoch, index): the same
    whatever the number of workers or ranks, and after a resume, where torch's per-worker
    seed would give other draws. In the loop's own process (``num_workers=0``) they come
    from the global RNG, which commits save."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: list[int]) -> list[Any]:
        seeded = isinstance(batch, _Batch) and tud.get_worker_info() is not None
        seed = batch.seed if isinstance(batch, _Batch) else 0
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is not None:  # one draw per batch: seeded by its first index
            if seeded:
                _seed_everything((seed * 1_000_003 + batch[0]) % 2**62)
            return list(batched(list(batch)))
        samples = []
        for index in batch:
            if seeded:
                _seed_everything((seed * 1_000_003 + index) % 2**62)
            samples.append(self.dataset[index])
        return samples

    def __getattr__(self, name: str) -> Any:  # the user's dataset's own attributes
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


class _HandedOut:
    """The batch sampler a torch DataLoader sees: the ElasticSampler's batches, with the
    offset after each one queued until the loop receives it."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler
        self.pending: deque[int] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        self.pending = deque()  # a new iterator (or a persistent one reset): nothing pending
        return self.sampler._batches(self.pending)

    def __len__(self) -> int:
        return len(self.sampler)


class DataLoader(tud.DataLoader):
    """``torch.utils.data.DataLoader`` whose commits record the batches the loop consumed.

    Takes the DataLoader's arguments, with one of

    - ``global_batch_size=G`` alone: a fixed global batch, shuffled unless
      ``shuffle=False``, the last incomplete batch of an epoch dropped unless
      ``drop_last=False``;
    - ``batch_sampler=ElasticSampler(...)``;
    - ``sampler=torch.utils.data.DistributedSampler(dataset, shuffle=..., seed=...)`` and
      ``batch_size=b`` (a fixed per-rank batch, as torchrun code has it) or
      ``global_batch_size=G`` (a fixed global batch): its ``shuffle``, ``seed`` and
      ``set_epoch`` are followed; ``drop_last`` is the DataLoader's.

    Workers, ``prefetch_factor``, ``persistent_workers`` and ``pin_memory`` work as in torch.
    Pass the loader (or its ``elastic_sampler``) to ``State``. Random draws stay exact
    across resumes: in worker processes each sample's draws start from a seed of (seed,
    epoch, index), and the workers' base seed does not come from the global RNG (unless
    you give a ``generator``). ``loader.dataset`` is a view of yours (its attributes pass
    through; yours is ``loader.dataset.dataset``). Only map-style datasets.

    Args:
        dataset: A map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: With a DistributedSampler: a fixed per-rank batch.
        shuffle: With ``global_batch_size`` alone (default True); beside a sampler, the
            sampler's ``shuffle`` decides (ValueError if given).
        sampler: A ``torch.utils.data.DistributedSampler``.
        batch_sampler: An ``ElasticSampler``.
        global_batch_size: A fixed global batch (alone, or with a DistributedSampler).
        **options: torch's DataLoader's other arguments (``in_order=False`` is refused).

    Attributes:
        elastic_sampler: The ElasticSampler that keeps the position (made from a
            DistributedSampler's settings when given one).

    Raises:
        TypeError: An iterable-style dataset, or no global batch size and neither
            sampler.
        ValueError: ``shuffle``, ``in_order=False``, or a sampler or batch size beside an
            ElasticSampler.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, *,
                 global_batch_size: int | None = None, **options: Any) -> None:
        if isinstance(dataset, tud.IterableDataset):
            raise TypeError(
                "elastic_magic.DataLoader needs a map-style dataset (__getitem__ and "
                "__len__): an iterable-style dataset has no position to resume from. Index "
                "your data, or keep its position in an object with state_dict/"
                "load_state_dict passed to State and use a torch DataLoader with "
                "num_workers=0")
        if options.get("in_order") is False:
            raise ValueError("elastic_magic.DataLoader needs in_order=True: the position "
                             "counts batches in the order the sampler handed them out")
        self.distributed_sampler = None
        if shuffle is not None and (sampler is not None or batch_sampler is not None):
            raise ValueError("elastic_magic.DataLoader takes shuffle from its sampler: "
                             "ElasticSampler(shuffle=...) or DistributedSampler(shuffle=...)")
        if sampler is None and batch_sampler is None and global_batch_size is not None:
            # the short form: shuffled (as DistributedSampler and ElasticSampler are), full
            # batches only, so that every step sees the same global batch
            elastic = ElasticSampler(len(dataset), global_batch_size,
                                     shuffle=True if shuffle is None else shuffle,
                                     drop_last=options.get("drop_last", True))
        elif isinstance(batch_sampler, ElasticSampler):
            if sampler is not None or batch_size not in (1, None) or global_batch_size:
                raise ValueError("batch_sampler=ElasticSampler(...) sets the batches: give "
                                 "its sizes to the ElasticSampler, and no sampler")
            elastic = batch_sampler
        elif isinstance(sampler, tud.DistributedSampler):
            self.distributed_sampler = sampler
            per_rank = None if global_batch_size is not None else batch_size
            elastic = ElasticSampler(len(dataset), global_batch_size, batch_size=per_rank,
                                     seed=sampler.seed, shuffle=sampler.shuffle,
                                     drop_last=options.get("drop_last", False))
        else:
            raise TypeError(
                "elastic_magic.DataLoader needs global_batch_size=, "
                "batch_sampler=elastic_magic.ElasticSampler(...), or "
                "sampler=DistributedSampler(...) with batch_size= (per rank) or "
                "global_batch_size=")
        options.pop("drop_last", None)
        self.elastic_sampler = elastic
        self._seeds = options.get("generator") is None
        if self._seeds:
            options["generator"] = torch.Generator()
        self._handed_out = _HandedOut(elastic)
        super().__init__(_SeededDataset(dataset), batch_sampler=self._handed_out, **options)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        elastic = self.elastic_sampler
        if self.distributed_sampler is not None:
            elastic.set_epoch(self.distributed_sampler.epoch)
        if self._seeds:
            self.generator.manual_seed(elastic.seed * 1_000_003 + elastic.epoch)
        iterator = super().__iter__()  # asks _HandedOut for a new iterator: new `pending`
        return _consumed(iterator, self._handed_out.pending, elastic)

    def state_dict(self) -> dict[str, int]:
        """The position of the batches the loop received (``ElasticSampler.state_dict``).

        Returns:
            ``{"epoch": ..., "offset": ...}``.
        """
        return self.elastic_sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Go back to a position (``state_dict``'s), at any world size.

        Args:
            state: What ``state_dict`` returned.
        """
        self.elastic_sampler.load_state_dict(state)


def _consumed(batches: Any, pending: deque[int], sampler: ElasticSampler) -> Iterator[Any]:
    """Yield the DataLoader's batches; the sampler's position moves to the end of each as
    the loop receives it (before the step that a commit then records)."""
    for batch in batches:
        sampler.offset = pending.popleft()
        yield batch
    sampler._finished_here = True

