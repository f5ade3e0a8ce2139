"""The cell's default process group: made on first use, unless the cell makes its own.

Two kinds of cells must both run with the default flags:

- cells that just use ``torch.distributed`` (collectives, DDP, ``State``) and expect a group;
- torchrun scripts, PyTorch Lightning and accelerate, which call ``init_process_group``
  themselves with their own backend and timeout (a second call raises "trying to initialize
  the default process group twice!"; the frameworks skip theirs, settings and all, when
  ``torch.distributed.is_initialized()`` is already True).

So the worker makes no group before the cell runs; it *arms* one (:func:`arm`):

- Every use of the default group in torch goes through torch's private default-group
  lookup (get_rank, get_world_size, collectives, DDP, new_group, barrier, object
  collectives), which first calls ``is_initialized`` from its own module,
  ``distributed_c10d``. That name is pointed at :func:`ensure`
  (``torch_internals.route_default_group_checks``), which makes the armed group (job's
  backend and timeout) and then answers. Every rank must use the group for all of them to
  get past that first use.
- The public ``torch.distributed.is_initialized`` is left as torch's: it stays False until
  something uses the group, so code that initialises "if not initialised yet" does, with its
  own settings.
- ``init_process_group`` disarms first, so the caller's call makes the group, once, with the
  caller's arguments. If the automatic group was already made, it says how to fix that.

``device_mesh`` holds its own reference to ``is_initialized`` and calls
``init_process_group()`` when it sees no group: it is pointed at :func:`ensure` as well, so a
mesh gets the job's group. Once the group is made (or disarmed), torch behaves as unpatched.

``group.WORLD`` itself is not hooked: modules read it when imported (as a default argument,
``torch.distributed.nn`` among them, which Lightning imports), and that must make nothing.
Until the group is made it is None, as in torch before init: the c10d collectives take that
as "the default group" and make it, but functional collectives (``_functional_collectives``)
refuse None, so such a cell uses the group some other way first, or calls init itself.
"""

from __future__ import annotations

import functools
import sys
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import torch_internals

_lock = threading.RLock()  # re-entered by the thread making the group (torch checks again)
_settings: dict[str, Any] | None = None  # armed: how to make the group
_busy = False  # armed, or being made: other threads wait for it
_made: Any = None  # the group made here, to tell it from the cell's own


def ensure() -> bool:
    """Whether the cell has a default group; an armed one is made first (a collective).
    While armed, torch's own ``is_initialized`` is this."""
    global _settings, _busy, _made
    if _busy:
        with _lock:  # another thread's first use waits here for the group
            settings, _settings = _settings, None
            if settings is not None:  # None: made meanwhile, or this is torch making it
                try:
                    _original_init(**settings)
                    _made = c10d.GroupMember.WORLD
                except Exception as exc:
                    _explain(exc, settings)
                    raise
                finally:
                    _busy = False
    return c10d.GroupMember.WORLD is not None


def _explain(exc: Exception, settings: dict[str, Any]) -> None:
    if sys.version_info >= (3, 11):  # add_note; the traceback shows where the cell used it
        exc.add_note(
            f"elastic_magic made the default process group here, where the cell first used "
            f"it (backend {settings['backend']}, timeout "
            f"{settings['timeout'].total_seconds():g} s): every rank must reach such a first "
            "use. Call init_process_group yourself, or start the cell with --no-init.")


def arm(backend: str, timeout: float) -> None:
    """Make the default group with these settings when the cell first uses it."""
    global _settings, _busy
    torch_internals.route_default_group_checks(ensure)
    c10d.init_process_group = dist.init_process_group = init_process_group
    with _lock:
        if c10d.GroupMember.WORLD is None:
            _settings = {"backend": backend, "timeout": timedelta(seconds=timeout)}
            _busy = True


def disarm() -> None:
    global _settings, _busy
    with _lock:
        _settings, _busy = None, False


# torch.distributed.init_process_group while armed (torch's docstring, torch's arguments).
def init_process_group(*args: Any, **kwargs: Any) -> None:
    if _made is not None and c10d.GroupMember.WORLD is _made:
        raise ValueError(
            "trying to initialize the default process group twice: elastic_magic made it "
            "when the cell first used torch.distributed, before this call. Call "
            "init_process_group before anything else uses the group, or start the cell with "
            "--no-init (init_process_group=False) to leave the group to it.")
    disarm()  # the caller's settings make the group
    _original_init(*args, **kwargs)


_original_init = c10d.init_process_group
functools.update_wrapper(init_process_group, _original_init)

# Groups the cell destroyed, kept until its payload has ended (release_destroyed). torch
# ends a gloo group on the thread that drops its last reference, GIL held: when that is the
# cell freeing its DDP model right after destroy_process_group, gloo's run-loop thread may
# still hold its work lock while it waits for the GIL to free the last collective's
# tensors, and the rank hangs for ever (the kind of pytorch/pytorch#56297; seen here in a
# torchrun script). Kept here, the group ends after the payload, with no work in flight.
_destroyed: list[Any] = []


def keep_destroyed_groups() -> None:
    """Point torch.distributed.destroy_process_group at :func:`destroy_process_group`."""
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group


def destroy_process_group(group: Any = None) -> None:
    kept = group if group is not None else c10d.GroupMember.WORLD
    if kept is not None:
        _destroyed.append(kept)
    _original_destroy(group)


def release_destroyed() -> None:
    """The payload has ended: the groups it destroyed may end now."""
    _destroyed.clear()


_original_destroy = c10d.destroy_process_group
functools.update_wrapper(destroy_process_group, _original_destroy)
