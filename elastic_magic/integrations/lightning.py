"""PyTorch Lightning, elastic the way a ``State`` loop is, with one line:

    trainer = pl.Trainer(strategy=ElasticDDP(every=5), max_steps=100, ...)   # was "ddp"
    trainer.fit(model, train_loader)

``ElasticDDP`` is Lightning's DDP strategy with what the job needs:

- **Commits.** Every ``every`` optimizer steps (at ``on_train_batch_end``, where Lightning's
  own ``ModelCheckpoint(every_n_train_steps=...)`` saves) it commits Lightning's checkpoint
  dict (model, optimizers, LR schedulers, precision plugin, the loops' progress, callbacks'
  state, the training loader's position) through an ``elastic_magic.State``, which adds
  every rank's random streams. In the agent's memory, never on disk.
- **Resume.** When ``trainer.fit`` starts in a job that has a commit (after a failure, a
  resize, or for a survivor running the cell again), Lightning restores that checkpoint as
  it would one given by ``ckpt_path`` (the commit wins over a ``ckpt_path`` file: it is
  newer), and goes on from the step after it.
- **World size.** ``devices`` and ``num_nodes`` are the job's (``LOCAL_WORLD_SIZE`` ranks
  on each machine, ``WORLD_SIZE`` in all): what the Trainer was given is ignored, so
  ``%elastic scale N`` needs no change to the cell.
- **Data.** The training DataLoader becomes an ``elastic_magic.DataLoader`` over an
  ``ElasticSampler`` with the same dataset, shuffle, seed and options: a fixed global batch
  (the loader's ``batch_size`` times the world size the training started at, kept across
  resizes), so a resize re-splits the same batches and the arithmetic of each step stays
  the same up to float rounding. Its position rides in Lightning's checkpoint (Lightning
  restores stateful loaders mid-epoch). Validation loaders are left as Lightning made them.

Lightning's checkpoint dict is made and restored through two private names of its Trainer
(``_checkpoint_connector.dump_checkpoint`` and ``._loaded_checkpoint``), kept in
``_LightningPrivate`` below and checked there: a Lightning that changed them is refused
with a message, never half-restored.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import pytorch_lightning as pl
import torch
import torch.utils.data as tud
from lightning_fabric.plugins.environments import TorchElasticEnvironment
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info

from ..training.data import DataLoader, ElasticSampler
from ..training.state import State

__all__ = ["ElasticDDP"]


class _LightningPrivate:
    """Every private name of Lightning this module uses, in one place (Lightning 2.6).

    The Trainer's ``_checkpoint_connector`` makes the checkpoint dict that ``save_checkpoint``
    writes (``dump_checkpoint``) and restores one that was loaded into
    ``_loaded_checkpoint`` (``resume_start`` sets it from ``ckpt_path``; given no path, it
    leaves it as it is and the restore steps of ``Trainer._run`` read it)."""

    @staticmethod
    def connector(trainer: pl.Trainer) -> Any:
        connector = getattr(trainer, "_checkpoint_connector", None)
        if not (callable(getattr(connector, "dump_checkpoint", None))
                and isinstance(getattr(connector, "_loaded_checkpoint", None), dict)
                and callable(getattr(connector, "resume_start", None))):
            raise RuntimeError(
                f"elastic_magic's Lightning integration relies on Trainer._checkpoint_"
                f"connector.dump_checkpoint and ._loaded_checkpoint, which Lightning "
                f"{pl.__version__} does not have as 2.6 did: report it (commits and resumes "
                "would not be exact)")
        return connector

    @classmethod
    def dump(cls, trainer: pl.Trainer) -> dict[str, Any]:
        """Lightning's whole checkpoint dict, as ``trainer.save_checkpoint`` writes it."""
        checkpoint: dict[str, Any] = cls.connector(trainer).dump_checkpoint(weights_only=False)
        return checkpoint

    @classmethod
    def preload(cls, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """Have ``trainer.fit`` restore ``checkpoint`` as if ``ckpt_path`` had loaded it."""
        cls.connector(trainer)._loaded_checkpoint = checkpoint


def _in_job() -> bool:
    """Running as a rank of a job (torchelastic's variables are set)."""
    return TorchElasticEnvironment.detect() and "LOCAL_WORLD_SIZE" in os.environ


class _JobEnvironment(TorchElasticEnvironment):
    """torchelastic's environment, whose world size is the job's whatever the Trainer was
    told (machines may hold different numbers of ranks)."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Nothing to check: ``ElasticDDP`` takes its devices from the job.

        Args:
            num_devices: Ignored.
            num_nodes: Ignored.
        """


class _Checkpoint:
    """Lightning's checkpoint as a ``State`` object: ``state_dict`` dumps the trainer's,
    ``load_state_dict`` keeps the restored one for ``trainer.fit`` to restore."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return _LightningPrivate.dump(self.trainer)

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        self.restored = checkpoint


class _Commits(Callback):
    """The strategy's hooks in the training loop: a commit after an optimizer step, and
    the check that Lightning resumed where the commit was."""

    def __init__(self, strategy: ElasticDDP) -> None:
        self.strategy = strategy

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored = self.strategy.restored_step
        if restored is not None and trainer.global_step != restored:
            raise RuntimeError(
                f"Lightning {pl.__version__} did not restore elastic_magic's commit of step "
                f"{restored} (it starts at step {trainer.global_step}): report it")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.strategy.commit(trainer)


class ElasticDDP(DDPStrategy):
    """Lightning's DDP strategy, elastic: commits every ``every`` optimizer steps to the job's
    agent, resumes ``trainer.fit`` from the last commit after a failure or a resize, takes
    the world size from the job and makes the training data resumable (see the module).

    Outside a job it is Lightning's ``DDPStrategy`` with the same arguments.

    Args:
        every: Commit on every ``every``-th optimizer step (global steps that are multiples
            of it, so a resumed run commits where an uninterrupted one does).
        seconds: Also commit once this many seconds have passed since the last commit.
        global_batch_size: The global batch of the training loader, split evenly across
            the ranks (it must divide by every world size the job takes). Default: the
            loader's ``batch_size`` times the world size of the run that made the first
            commit, kept across resizes.
        **ddp_options: ``DDPStrategy``'s arguments (``process_group_backend``,
            ``timeout``, ``find_unused_parameters``, ...).

    Attributes:
        state: The ``elastic_magic.State`` that commits Lightning's checkpoint (set when
            ``fit`` starts).
        restored_step: The global step ``fit`` resumed from (None: it started afresh).

    Raises:
        ValueError: ``every`` is below 1.

    Example:
        >>> trainer = pl.Trainer(strategy=ElasticDDP(every=5), max_steps=100)
        >>> trainer.fit(model, loader)  # after a kill or a resize: from the last commit
    """

    def __init__(self, every: int = 1, *, seconds: float | None = None,
                 global_batch_size: int | None = None, **ddp_options: Any) -> None:
        if every < 1:
            raise ValueError(f"ElasticDDP(every={every}): give a number of steps, 1 or more")
        if _in_job():
            ddp_options.setdefault("cluster_environment", _JobEnvironment())
        super().__init__(**ddp_options)
        self.every, self.seconds, self.global_batch_size = every, seconds, global_batch_size
        self.state: State | None = None
        self.restored_step: int | None = None
        self._checkpoint: _Checkpoint | None = None
        self._committed_at: int | None = None  # the last global step offered to commit
        self._sigterm: Any = None  # SIGTERM's action before fit

    def _configure_launcher(self) -> None:
        # In a job, every rank is already running: nothing to launch. Lightning's launcher
        # would only refuse to work where ``sys.ps1`` is set (an interactive-looking rank).
        if _in_job():
            self._launcher = None
        else:
            super()._configure_launcher()

    # -- the world size is the job's ----------------------------------------------------

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """This machine's devices: one per rank of the job here (``LOCAL_WORLD_SIZE``), of
        the kind the Trainer chose; settable (the count is the job's, in a job)."""
        return self._job_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices and _in_job():
            kind = torch.device(devices[0]).type
            local = int(os.environ["LOCAL_WORLD_SIZE"])
            devices = [torch.device(kind, i) if kind == "cuda" else torch.device(kind)
                       for i in range(local)]
        self._job_devices = devices

    @property
    def num_nodes(self) -> int:
        """The job's machines (``GROUP_WORLD_SIZE``), in a job; settable outside one."""
        return int(os.environ.get("GROUP_WORLD_SIZE", "1")) if _in_job() else self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank of the job (machines may hold different numbers of ranks)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- restore and commit -------------------------------------------------------------

    def _trainer(self) -> pl.Trainer:
        module = self.lightning_module
        assert module is not None, "the strategy is used before fit connected a module"
        return module.trainer

    def connect(self, model: pl.LightningModule) -> None:
        """Lightning's, and this strategy's loop hooks join the trainer's callbacks.

        Args:
            model: The LightningModule ``fit`` was given.
        """
        super().connect(model)
        callbacks: list[Callback] = model.trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, _Commits) and c.strategy is self for c in callbacks):
            callbacks.append(_Commits(self))

    def setup_environment(self) -> None:
        """Lightning's (the process group), then, in ``fit``, the job's last commit, if
        any, loaded for ``fit`` to restore (``validate``, ``test`` and ``predict`` neither
        restore nor commit)."""
        super().setup_environment()
        self._sigterm = signal.getsignal(signal.SIGTERM)  # before Lightning's (fit's _run)
        self.state, self.restored_step = None, None
        trainer = self._trainer()
        if trainer.state.fn != TrainerFn.FITTING:  # validate, test, predict: as DDP
            return
        _LightningPrivate.connector(trainer)  # a Lightning that changed fails here, at once
        self._checkpoint = _Checkpoint(trainer)
        self._committed_at = None
        self.state = State(lightning=self._checkpoint, global_batch_size=None, step=0)
        restored = self._checkpoint.restored
        self.restored_step = None if restored is None else int(restored["global_step"])
        if restored is not None:
            _LightningPrivate.preload(trainer, restored)
            rank_zero_info(f"elastic_magic: resuming from the commit of step "
                           f"{self.restored_step} at world size {self.world_size}")

    def on_train_start(self) -> None:
        """Lightning's, and in a job SIGTERM gets back the action it had before ``fit``.

        Lightning's SIGTERM handler logs and broadcasts a flag from inside the handler, so
        the rank goes on; in a job SIGTERM is the agent's word to end the rank (the group
        is being stopped: a peer died, the kernel is interrupted). Broadcasting from the
        handler to a dead peer hung a survivor until the agent's SIGKILL (38 s seen).
        Lightning puts its saved action back at the end of ``fit`` anyway.
        """
        super().on_train_start()
        if _in_job() and self._sigterm is not None \
                and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """The job's last commit where there is one (it is newer than any file), else the
        file, as Lightning loads it.

        Args:
            checkpoint_path: ``fit``'s ``ckpt_path``.
            weights_only: As Lightning's.

        Returns:
            The checkpoint dict.
        """
        if self._checkpoint is not None and self._checkpoint.restored is not None:
            return self._checkpoint.restored
        checkpoint: dict[str, Any] = super().load_checkpoint(checkpoint_path, weights_only)
        return checkpoint

    def commit(self, trainer: pl.Trainer) -> bool:
        """Commit after an optimizer step (the strategy's callback calls it at each
        ``on_train_batch_end``; a batch that only accumulated is skipped). A pending resize
        leaves here, at a commit.

        Args:
            trainer: The Trainer.

        Returns:
            True when it committed.
        """
        step = trainer.global_step
        if self.state is None or step == self._committed_at:
            return False
        self._committed_at = step
        self.state.step = step
        if step % self.every == 0:
            return self.state.commit()
        if self.seconds is not None:  # every rank asks at the same steps: they agree
            return self.state.commit(every=sys.maxsize, seconds=self.seconds)
        return False

    # -- the training data ----------------------------------------------------------------

    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader made resumable (``elastic_magic.DataLoader``, a fixed global
        batch); others as Lightning made them.

        Args:
            dataloader: A loader as Lightning prepared it (its DistributedSampler in).

        Returns:
            The loader to iterate.
        """
        dataloader = super().process_dataloader(dataloader)
        trainer = self._trainer()
        if not _in_job() or not trainer.training or self.state is None:
            return dataloader
        if isinstance(dataloader, DataLoader):
            return dataloader
        per_rank = getattr(dataloader, "batch_size", None)
        committed = self.state.global_batch_size
        size = self.global_batch_size or committed or (per_rank or 0) * self.world_size
        self.state.global_batch_size = size
        return _elastic_loader(dataloader, size)


def _elastic_loader(loader: Any, global_batch_size: int) -> DataLoader:
    """``loader`` (a torch DataLoader, its sampler shuffled or not, or a DistributedSampler
    over the whole dataset) as an ``elastic_magic.DataLoader`` with the same order and
    options."""
    refused = "ElasticDDP resumes the training data from its position in an epoch: "
    if not isinstance(loader, tud.DataLoader) or isinstance(loader.dataset, tud.IterableDataset):
        raise TypeError(refused + f"it needs a torch DataLoader over a map-style dataset, not "
                        f"{type(loader).__name__}")
    sampler = loader.sampler
    if type(loader.batch_sampler) is not tud.BatchSampler or loader.batch_size is None:
        raise TypeError(refused + "it needs a DataLoader with batch_size (its batch_sampler "
                        "makes the batches)")
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    if type(sampler) is tud.DistributedSampler:
        shuffle, seed = sampler.shuffle, sampler.seed
    elif type(sampler) in (tud.RandomSampler, tud.SequentialSampler):
        shuffle = isinstance(sampler, tud.RandomSampler)
    else:
        raise TypeError(refused + f"it cannot follow the order of a {type(sampler).__name__}"
                        " (give the DataLoader shuffle=True or False)")
    options = {name: getattr(loader, name) for name in (
        "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
        "multiprocessing_context", "persistent_workers", "pin_memory_device")
        if hasattr(loader, name)}
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    if loader.generator is not None:
        options["generator"] = loader.generator
    elastic = ElasticSampler(len(loader.dataset), global_batch_size,  # type: ignore[arg-type]
                             seed=seed, shuffle=shuffle, drop_last=loader.drop_last)
    return DataLoader(loader.dataset, batch_sampler=elastic, **options)
