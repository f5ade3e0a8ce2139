"""HuggingFace transformers' ``Trainer``, elastic in one line: ``ElasticCallback``.

    from elastic_magic.integrations.transformers import ElasticCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[ElasticCallback(every=5)])
    trainer.train()   # after a kill or a resize: from the last commit, not from step 0

Every ``every`` optimizer steps the callback commits an ``elastic_magic.State`` (in the
agent's memory): the model, the optimizer, the LR scheduler, the grad scaler if any, the
``TrainerState`` (global step, epoch, log history, best metric, the stateful callbacks as
HF's checkpoints keep them), the loss added up since the last log, the FLOs not yet added
up, and every rank's random streams (torch, CUDA, python, numpy). The commit is taken at
the start of the next optimizer step (``on_step_begin``), once that step's batches are
fetched and before its forward: what came after the step (its log, its evaluation, the
best metric) is in it, and the random streams are those the next forward draws from.

When the cell runs again (a restart, a resize, a survivor running the cell again),
``trainer.train()`` goes on from the last commit through HF's own resume path, as
``train(resume_from_checkpoint=...)`` would: its loop starts at the committed global step
and epoch and skips the batches already trained on (accelerate's ``skip_first_batches``).
The callback gives that path a private folder holding only ``trainer_state.json`` (removed
once the loop has read it) and restores everything else from the commit in memory, at
``on_train_begin`` (the objects) and before the first forward (the random streams).

The data position is the global step: HF's data order (accelerate's seeded sampler, one
permutation per epoch, per-device batches dealt to the ranks in turn) gives the same global
batches at any world size when the global batch (per-device batch x world size x gradient
accumulation) is the same, so a resize must keep it (``per_device_train_batch_size=G //
WORLD_SIZE``); a commit made with another global batch is refused, saying so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from ..training import rng
from ..training.collectives import distributed, rank_and_world
from ..training.state import State

__all__ = ["ElasticCallback"]

# -- transformers' private names, in this one place ------------------------------------
# HF's Trainer resumes its loop (epoch, step, batches skipped, TrainerState) only through
# ``train(resume_from_checkpoint=folder)``. The folder given holds only trainer_state.json:
# HF's loaders of the optimizer, scheduler, scaler and random states find no file there
# and load nothing (the commit restores those), but its model loader raises on a folder
# without weights. For that one call it is replaced on the Trainer instance by one that
# loads nothing from our folder (the commit restores the model at on_train_begin) and
# calls HF's for any other. Checked on import: a transformers without it (or with another
# signature) fails here, loudly, rather than resuming wrongly.
_LOAD_MODEL = "_load_from_checkpoint"  # (self, resume_from_checkpoint, model=None)
_TRAINER_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
# What the loop adds up between logs (each rank's loss tensor, the step of the last log,
# the logged losses' sum for train_loss), set when it starts, checked at on_train_begin.
# HF's resume starts them afresh; committed, the logs after a restore are the run's own.
_LOOP_LOSS = "_tr_loss"
_LAST_LOGGED = "_globalstep_last_logged"
_LOGGED_TOTAL = "_total_loss_scalar"


def _check_transformers() -> None:
    import transformers
    import transformers.trainer as hf_trainer

    method = getattr(Trainer, _LOAD_MODEL, None)
    names = list(inspect.signature(method).parameters)[:3] if callable(method) else []
    if names != ["self", "resume_from_checkpoint", "model"] or getattr(
            hf_trainer, "TRAINER_STATE_NAME", None) != _TRAINER_STATE_FILE:
        raise ImportError(
            f"elastic_magic's ElasticCallback resumes through Trainer.{_LOAD_MODEL}"
            f"(resume_from_checkpoint, model) and {_TRAINER_STATE_FILE}, which transformers "
            f"{transformers.__version__} does not have as it expects (found {names or 'none'})"
            ": report it, with this version")


_check_transformers()


def _check_loop(trainer: Trainer) -> None:
    import torch
    import transformers

    if not (isinstance(getattr(trainer, _LOOP_LOSS, None), torch.Tensor)
            and isinstance(getattr(trainer, _LAST_LOGGED, None), int)
            and isinstance(getattr(trainer, _LOGGED_TOTAL, None), float)):
        raise RuntimeError(
            f"elastic_magic's ElasticCallback keeps the loss the Trainer adds up between logs "
            f"(Trainer.{_LOOP_LOSS}, .{_LAST_LOGGED}, .{_LOGGED_TOTAL}), which transformers "
            f"{transformers.__version__} does not have as it expects: report it, with this "
            "version")
# ---------------------------------------------------------------------------------------

_FOLDER_PREFIX = "em-hf-resume-"


class _Deferred:
    """A Trainer object as ``State`` sees it: saved from ``get()``; a restore is kept
    until ``flush()`` (at ``on_train_begin``: the optimizer, its scheduler and the scaler
    are made inside ``train()``, after the restore, and so is the model with
    ``model_init``)."""

    def __init__(self, get: Callable[[], Any]) -> None:
        self.get = get
        self.pending: Any = None

    def state_dict(self) -> Any:
        live = self.get()
        return None if live is None else live.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.pending = state

    def flush(self) -> None:
        live, state, self.pending = self.get(), self.pending, None
        if live is not None and state:  # {}: nothing saved (a disabled GradScaler's)
            live.load_state_dict(state)


class _TrainerStateRecord:
    """The ``TrainerState`` as HF's checkpoints save it (its fields, with the state of
    each stateful callback and of the ``TrainerControl``); a restore keeps it for the
    resume folder's ``trainer_state.json``."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        trainer, saved = self.trainer, dataclasses.asdict(self.trainer.state)
        states: dict[str, list[Any]] = {}
        for callback in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(callback, ExportableState):
                states.setdefault(type(callback).__name__, []).append(callback.state())
        saved["stateful_callbacks"] = {  # several of one kind: a list, as HF keeps them
            name: found[0] if len(found) == 1 else found for name, found in states.items()}
        return {"json": json.dumps(saved, sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = json.loads(state["json"])


class _LoggedLoss(_Deferred):
    """What the loop added up since its last log: every rank's loss (a commit gathers
    them), and the step of that log. Restored at the same world size, each rank takes its
    own; at another, each takes their mean (the log averages over the ranks)."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(lambda: trainer)
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any] | None:
        import torch

        loss = getattr(self.trainer, _LOOP_LOSS, None)
        if loss is None:  # before the loop
            return None
        mine = loss.detach().reshape(1).clone()
        dist = distributed()
        losses = [mine]
        if dist is not None:  # a commit: every rank is here
            mine = mine.to(rng.collective_device(dist))
            losses = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(losses, mine)
        return {"losses": torch.cat([part.cpu() for part in losses]),
                "last_logged": getattr(self.trainer, _LAST_LOGGED)}

    def flush(self) -> None:
        state, self.pending = self.pending, None
        if state is None:
            return
        rank, world = rank_and_world()
        losses = state["losses"]
        mine = losses[rank] if len(losses) == world else losses.mean()
        getattr(self.trainer, _LOOP_LOSS).copy_(mine)
        setattr(self.trainer, _LAST_LOGGED, state["last_logged"])
        # The final train_loss covers this train() call, as after HF's resume: the loss
        # restored here is taken off the sum that the next log adds it to.
        setattr(self.trainer, _LOGGED_TOTAL, -float(losses.mean()))


def _global_batch(args: Any) -> int:
    """Samples per optimizer step, all ranks together."""
    return int(args.train_batch_size * args.gradient_accumulation_steps * args.world_size)


def _check_global_batch(committed: int, args: Any) -> None:
    if committed != _global_batch(args):
        raise ValueError(
            f"ElasticCallback cannot resume: the last commit was made with a global batch "
            f"of {committed} samples per optimizer step, this run has {_global_batch(args)} "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} x world size "
            f"{args.world_size} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps}). HF's Trainer counts its data position in "
            "optimizer steps, so a resize must keep the global batch: give "
            "per_device_train_batch_size=G // int(os.environ['WORLD_SIZE']), G divisible by "
            "every world size")


def _trainer_being_made(callback: ElasticCallback) -> Trainer:
    """The Trainer whose ``__init__`` is running with ``callback`` among its callbacks
    (``on_init_end`` is called from there); callbacks are not told their Trainer."""
    for caller in inspect.stack(0):
        owner = caller.frame.f_locals.get("self")
        if isinstance(owner, Trainer) and any(cb is callback for cb in getattr(
                getattr(owner, "callback_handler", None), "callbacks", ())):
            return owner
    raise RuntimeError("ElasticCallback did not find the Trainer it was given to: pass it as "
                       "Trainer(..., callbacks=[ElasticCallback(...)])")


def _resume_folder(trainer_state: dict[str, Any]) -> str:
    """A private folder (in memory where /dev/shm is) holding ``trainer_state.json``."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else None
    with contextlib.suppress(OSError):
        _remove_stale(base or tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-", dir=base)
    with open(os.path.join(folder, _TRAINER_STATE_FILE), "w", encoding="utf-8") as file:
        json.dump(trainer_state, file)
    return folder


def _remove_stale(base: str) -> None:
    """Folders of ours whose process is gone (one killed before its loop read it)."""
    for entry in os.scandir(base):
        pid = entry.name.removeprefix(_FOLDER_PREFIX).partition("-")[0]
        if entry.name.startswith(_FOLDER_PREFIX) and pid.isdigit() and \
                entry.stat(follow_symlinks=False).st_uid == os.getuid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 0)
                continue
            shutil.rmtree(entry.path, ignore_errors=True)


class ElasticCallback(TrainerCallback):
    """Makes HF's ``Trainer`` elastic: it commits every ``every`` optimizer steps, and
    after a restart or a resize ``trainer.train()`` goes on from the last commit (see the
    module's text). Give it to the Trainer when making it:
    ``Trainer(..., callbacks=[ElasticCallback(every=10)])``. At the end of the Trainer's
    ``__init__`` it wraps that Trainer's ``train``, which restores the commit.

    Outside a job it commits and restores nothing. One ``train()`` per job: a second one
    would resume from the first one's last commit. Not with DeepSpeed or FSDP (refused).
    A ``resume_from_checkpoint`` given to ``train()`` is used while the job has no commit
    (its first run); after that the commit, newer, wins.

    Args:
        every: Commit every ``every`` optimizer steps (``State.commit(every=...)``).
        seconds: Also commit once this many seconds have passed since the last commit.

    Attributes:
        elastic_state: The ``elastic_magic.State`` of the last ``train()`` (None before).

    Raises:
        ValueError: ``every`` is below 1; at ``train()``, a commit made with another
            global batch (per-device batch x world size x gradient accumulation).
        RuntimeError: Not given to the Trainer when it was made (at ``train()``), or the
            Trainer uses DeepSpeed or FSDP.

    Example:
        >>> trainer = Trainer(model, args, train_dataset=data,
        ...                   callbacks=[ElasticCallback(every=10)])
        >>> trainer.train()  # resumes in memory after a failure or a resize
    """

    def __init__(self, every: int = 1, seconds: float | None = None) -> None:
        if every < 1:
            raise ValueError(f"ElasticCallback(every={every}): give a number of optimizer "
                             "steps, 1 or more")
        self.every = every
        self.seconds = seconds
        self.elastic_state: State | None = None  # that of the last train()
        self._trainer: Trainer | None = None
        self._deferred: list[_Deferred] = []
        self._rng: dict[str, Any] | None = None  # the commit's, for the first step
        self._folder: str | None = None
        self._seen_step = 0  # the global step of the last on_step_begin that counted
        self._flos: float | None = None

    # -- set-up: at the end of Trainer.__init__ -------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Find the Trainer and wrap its ``train`` (see the class).

        Args:
            args, state, control, **kwargs: What HF passes to every callback.

        Raises:
            RuntimeError: The Trainer uses DeepSpeed or FSDP, or was not found.
        """
        trainer = _trainer_being_made(self)
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise RuntimeError("ElasticCallback does not support DeepSpeed or FSDP yet: "
                               "their states are sharded in their own formats")
        self._trainer, original = trainer, trainer.train

        @functools.wraps(original)
        def train(resume_from_checkpoint: Any = None, trial: Any = None,
                  ignore_keys_for_eval: Any = None, **more: Any) -> Any:
            return self._train(trainer, original, resume_from_checkpoint, trial,
                               ignore_keys_for_eval, **more)

        trainer.train = train  # type: ignore[method-assign]

    def _train(self, trainer: Trainer, original: Callable[..., Any],
               resume_from_checkpoint: Any, trial: Any, ignore_keys_for_eval: Any,
               **more: Any) -> Any:
        self._trainer, before = trainer, rng.current()
        model, optimizer, scheduler, scaler = (_Deferred(get) for get in (
            lambda: trainer.model, lambda: trainer.optimizer, lambda: trainer.lr_scheduler,
            lambda: trainer.accelerator.scaler))
        record, loss = _TrainerStateRecord(trainer), _LoggedLoss(trainer)
        self.elastic_state = State(model=model, optimizer=optimizer, scheduler=scheduler,
                                   scaler=scaler, trainer_state=record, logged_loss=loss,
                                   global_batch=_global_batch(trainer.args), flos=0.0, step=0)
        self._deferred = [model, optimizer, scheduler, scaler, loss]
        self._seen_step, self._rng, self._flos = 0, None, None
        if record.restored is None:  # nothing committed yet: as without us
            return original(resume_from_checkpoint, trial, ignore_keys_for_eval, **more)
        # The commit set this rank's random streams; the first step takes them back (HF's
        # own loader draws in between), what runs until then starts as without a restore.
        self._rng = rng.current()
        rng.apply(before)
        _check_global_batch(self.elastic_state.global_batch, trainer.args)
        self._seen_step = int(record.restored["global_step"])
        self._flos = float(self.elastic_state.flos)
        saved = dict(record.restored)
        if not trainer.args.auto_find_batch_size:  # this world size's (no warning)
            saved["train_batch_size"] = trainer.args.train_batch_size
        folder = self._folder = _resume_folder(saved)
        load_model = getattr(trainer, _LOAD_MODEL)

        def load(resume_from_checkpoint: str, model: Any = None) -> None:
            if resume_from_checkpoint != folder:  # ours: the commit restores the model
                load_model(resume_from_checkpoint, model)

        setattr(trainer, _LOAD_MODEL, load)
        try:
            return original(folder, trial, ignore_keys_for_eval, **more)
        finally:
            with contextlib.suppress(AttributeError):
                delattr(trainer, _LOAD_MODEL)
            self._remove_folder()

    def _remove_folder(self) -> None:
        folder, self._folder = self._folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    # -- the loop ------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The model, optimizer, scheduler and scaler are made (and the model wrapped):
        restore them, and the loss added up since the last log, from the commit.

        Args:
            args, state, control, **kwargs: What HF passes to every callback.

        Raises:
            RuntimeError: This callback was added after the Trainer was made.
        """
        if self._trainer is None or self.elastic_state is None:
            raise RuntimeError("ElasticCallback must be given to the Trainer when it is made, "
                               "Trainer(..., callbacks=[ElasticCallback(...)]): added later "
                               "(add_callback) it cannot resume the loop")
        self._remove_folder()  # HF has read it
        _check_loop(self._trainer)
        for deferred in self._deferred:
            deferred.flush()
        if self._flos is not None:  # FLOs counted since HF last added them up
            self._trainer.current_flos = self._flos  # type: ignore[assignment]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Before each optimizer step's forward: the first after a restore takes the
        commit's random streams; the others commit the step before, every ``every``.

        Args:
            args, state, control, **kwargs: What HF passes to every callback.
        """
        if self._rng is not None:
            rng.apply(self._rng)
            self._rng = None  # once
        if self.elastic_state is None or state.global_step == self._seen_step:
            return  # the first step, or the first since the restore
        self._seen_step = state.global_step
        assert self._trainer is not None
        self.elastic_state.step = state.global_step
        self.elastic_state.flos = float(self._trainer.current_flos)
        self.elastic_state.commit(every=self.every, seconds=self.seconds)
