"""Survivors stay in a session: what a rank that joins gets of a survivor's namespace.

The new ranks replay the setup cells first; then a survivor sends them what they still
lack of its ``__main__`` (``export``): functions and classes it defined, by value, and
its picklable values, each on its own, so that one that cannot be sent is named with the
reason, not the others lost; modules travel by name; names that start with ``_`` stay.
Not sent: values above a size (``LIMIT``), objects tied to the survivor's process or
process group (a DDP model, a ``State``, a distributed sampler: the setup cells make
those), tensors on its GPU, anything pickle refuses. Its functions (a class's methods
too) are sent without the globals they read and bound on the new rank to that rank's own
namespace (``_rebind``): ``train`` uses the new rank's model and ``State``, not copies of
the survivor's. A new rank takes only the names it does not have (``absorb``): what its
setup cells made stays.

While a new rank lacks something, each cell is checked first (``check``), on the new
ranks alone: one that reads what they lack fails naming those names, and runs on no rank,
rather than leaving the survivors in a collective that the new rank never joins.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import io
import itertools
import marshal
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle

from elastic_magic.stacks import CELL_FILENAME
from elastic_magic.wire.shipped import ShippedNamespace
from elastic_magic.worker.cell_reads import code_of, needed
from elastic_magic.worker.session_cells import namespace

LIMIT = 64 * 2**20  # bytes, one value pickled (or its tensors, before pickling)
TOTAL = 512 * 2**20  # bytes, all values together
# Objects of these modules hold the process, its process group or its rank's share: a
# setup cell makes them on every rank.
TIED = ("torch.distributed", "torch._C._distributed", "torch.nn.parallel",
        "torch.utils.data.distributed", "torch.utils.data.dataloader", "elastic_magic",
        "torch.multiprocessing", "multiprocessing", "subprocess", "socket")
LISTED = 12  # names listed in a line of output


def present() -> dict[str, str | None]:
    """The names this rank's namespace holds (a new rank, after its setup cells), each
    with the digest of its definition where it is a function or class of the cells."""
    return {name: _definition(value) for name, value in namespace().items()}


def export(have: dict[str, str | None], to: tuple[int, ...]) -> ShippedNamespace:
    """This survivor's variables that the new ranks ``to`` (which have ``have``) lack, and
    its functions and classes that they have under another definition (a cell redefined
    one that a setup cell made); says once, on this rank's output, what was sent and what
    was not."""
    space = namespace()
    rank = int(os.environ.get("RANK", "0"))
    redefined = frozenset(n for n, digest in have.items() if digest is not None
                          and n in space and _definition(space[n]) not in (None, digest))
    shipped = ShippedNamespace(rank, redefined=redefined)
    same = frozenset(have) - redefined
    total = 0
    for name in sorted(space):
        value = space[name]
        if name in same or name.startswith("_") or value is getattr(builtins, name, object()):
            continue
        if isinstance(value, types.ModuleType):
            if getattr(value, "__spec__", None) is None:
                shipped.skipped[name] = f"module {value.__name__!r}, not importable by name"
            else:
                shipped.modules[name] = value.__name__
            continue
        why, blob = _pickled(value, space, same)
        if blob is not None and total + len(blob) > TOTAL:
            why, blob = f"over the {_mib(TOTAL)} all values may take together", None
        if blob is None:
            shipped.skipped[name] = why
        else:
            shipped.values[name] = blob
            total += len(blob)
    _say(shipped, to)
    return shipped


def absorb(shipped: ShippedNamespace) -> dict[str, str]:
    """A new rank takes the names it does not have yet; what it lacks of the survivor's
    namespace after that (name -> why) is the agent's to remember."""
    space = namespace()
    lacking = {n: why for n, why in shipped.skipped.items() if n not in space}
    failed: dict[str, str] = {}
    for name, module in shipped.modules.items():
        if name not in space:
            try:
                space[name] = importlib.import_module(module)
            except Exception as exc:  # what the survivor imported may not be here
                failed[name] = f"module {module!r}: {type(exc).__name__}: {exc}"
    for name, blob in shipped.values.items():
        if name not in space or name in shipped.redefined:
            try:
                space[name] = cloudpickle.loads(blob)
            except Exception as exc:  # pickled there, not loadable here
                failed[name] = f"not loaded here: {type(exc).__name__}: {exc}"
    if failed:
        rank = os.environ.get("RANK", "?")
        print(f"[elastic] rank {rank} could not take these of rank {shipped.source}'s "
              f"variables, and lacks them: {_listed(failed)}", file=sys.stderr, flush=True)
    return {**lacking, **failed}


def check(source: str, lacking: dict[str, str], given: tuple[str, ...]) -> list[str]:
    """Before a cell, on a rank that joined: raise NameError naming the names the cell
    reads (itself, or through the functions and classes it calls) that this rank lacks;
    ``given`` are the kernel variables the cell brings. The names still lacked."""
    space = namespace()
    missing = {n: why for n, why in lacking.items() if n not in space}
    if not missing:
        return []
    try:
        reads = needed(source, CELL_FILENAME, space)
    except SyntaxError:  # the cell says so itself, where it runs
        return sorted(missing)
    used = sorted((reads & set(missing)) - set(given))
    if used:
        rank = os.environ.get("RANK", "?")
        raise NameError(
            f"rank {rank} lacks {', '.join(used)}, which this cell uses: the rank joined the "
            f"session after {'it was' if len(used) == 1 else 'they were'} defined, and "
            f"{'it' if len(used) == 1 else 'they'} could not be sent to it "
            f"({_listed({n: missing[n] for n in used})}). Define them again in a cell (in a "
            "setup cell, if ranks that join later need them too); the cell ran on no rank.")
    return sorted(missing)


# -- how values travel --------------------------------------------------------------------


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, but a function of the namespace travels without its globals, to be
    bound to the receiving rank's namespace; and a function or class of the namespace
    that the receiving rank has (``have``: its setup cells made it) is that rank's own."""

    def __init__(self, file: io.BytesIO, space: dict[str, Any], have: frozenset[str]
                 ) -> None:
        super().__init__(file)
        self.space, self.have = space, have

    def reducer_override(self, obj: Any) -> Any:
        # Inside a value too (a list of CUDA losses, a dict holding an optimizer made in an
        # ordinary cell): refused, and the value named with why.
        if (tied := _tied(obj)) is not None:
            raise TypeError(f"holds a {tied}, tied to this process or its process group "
                            "(make it in a setup cell)")
        if (device := _gpu(obj)) is not None:
            raise TypeError(f"holds a tensor on {device}, this rank's GPU (make it in a "
                            "setup cell)")
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            name: str = obj.__name__
            if name in self.have and self.space.get(name) is obj:
                return _named, (name,)
        if isinstance(obj, types.FunctionType) and obj.__globals__ is self.space:
            return _rebind, (_with_globals(obj, {"__name__": "__main__"}),)
        return super().reducer_override(obj)


def _named(name: str) -> Any:
    """On the receiving rank: its own function or class of that name."""
    return namespace()[name]


def _with_globals(fn: types.FunctionType, space: dict[str, Any]) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, space, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = fn.__annotations__
    new.__dict__.update(fn.__dict__)
    return new


def _rebind(fn: types.FunctionType) -> types.FunctionType:
    """On the receiving rank: the function, reading that rank's own globals."""
    return _with_globals(fn, namespace())


class _Bounded(io.BytesIO):
    """A buffer that refuses to grow past LIMIT: a large value is given up while it is
    pickled, not once it has taken that memory."""

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > LIMIT:
            raise _TooLarge
        return super().write(data)


class _TooLarge(Exception):
    """A value over LIMIT, found while it is pickled."""


def _pickled(value: Any, space: dict[str, Any], have: frozenset[str]
             ) -> tuple[str, bytes | None]:
    try:  # anything a value does while it is looked at or pickled: named, with the reason
        if (tied := _tied(value)) is not None:
            return f"{tied}: tied to this process or its process group (make it in a " \
                   "setup cell)", None
        if (device := _gpu(value)) is not None:
            return f"on {device}, this rank's GPU (make it in a setup cell)", None
        if (size := _tensor_bytes(value)) > LIMIT:
            return f"{type(value).__name__} of {_mib(size)}, over the {_mib(LIMIT)} " \
                   "limit", None
        buffer = _Bounded()
        _Pickler(buffer, space, have).dump(value)
    except _TooLarge:
        return f"{type(value).__name__} over the {_mib(LIMIT)} limit", None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", None
    return "", buffer.getvalue()


def _tied(value: Any) -> str | None:
    """The type of ``value`` (or of a module inside it) that ties it to this process."""
    objects: Iterator[Any] = iter((value,))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.nn.Module):
        objects = value.modules()
    for obj in objects:
        kind = type(obj)
        if isinstance(obj, type):
            return None  # a class: by value (ours by reference)
        if kind.__module__.startswith(TIED):
            return f"{kind.__module__}.{kind.__qualname__}"
    return None


def _tensors(value: Any) -> Iterator[Any]:
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, torch.nn.Module):
            yield from itertools.chain(value.parameters(), value.buffers())


def _gpu(value: Any) -> str | None:
    """The device of a tensor (of a module) on a GPU: it would land on the same device
    number of the new rank, which is not that rank's."""
    return next((str(t.device) for t in _tensors(value) if t.device.type != "cpu"), None)


def _tensor_bytes(value: Any) -> int:
    if size := sum(int(t.element_size() * t.nelement()) for t in _tensors(value)):
        return size
    nbytes = getattr(value, "nbytes", 0)  # a numpy array
    return nbytes if isinstance(nbytes, int) else 0


def _definition(value: Any) -> str | None:
    """A digest of the code of a function or class the cells defined (None for anything
    else): two ranks holding the same name under other definitions differ here."""
    if getattr(value, "__module__", None) != "__main__":
        return None
    codes = list(code_of(value))
    if not codes:
        return None
    digest = hashlib.sha256()
    for code in codes:
        digest.update(marshal.dumps(code))
    return digest.hexdigest()


# -- what the output says ----------------------------------------------------------------


def _say(shipped: ShippedNamespace, to: tuple[int, ...]) -> None:
    ranks = f"rank{'s' if len(to) > 1 else ''} {', '.join(map(str, to))}"
    sent = sorted([*shipped.values, *shipped.modules])
    if sent:
        more = f" and {len(sent) - LISTED} more" if len(sent) > LISTED else ""
        print(f"[elastic] rank {shipped.source} sent its variables to the new {ranks}: "
              f"{', '.join(sent[:LISTED])}{more}", file=sys.stderr, flush=True)
    if shipped.skipped:
        print(f"[elastic] not sent to the new {ranks}, which lack{'' if len(to) > 1 else 's'}"
              f" them until a cell defines them: {_listed(shipped.skipped)}",
              file=sys.stderr, flush=True)


def _listed(why: dict[str, str]) -> str:
    items = [f"{name} ({reason})" for name, reason in sorted(why.items())]
    more = f"; and {len(items) - LISTED} more" if len(items) > LISTED else ""
    return "; ".join(items[:LISTED]) + more


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size < 2**30 else f"{size / 2**30:.1f} GiB"
