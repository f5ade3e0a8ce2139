"""Every rank's random streams, gathered as plain bytes of one fixed layout.

A commit stores each rank's RNG states (Python's, torch's CPU and CUDA generators, numpy's
global one). They travel between ranks over gloo or NCCL, which nobody authenticates, so
they go as a fixed-size byte tensor that is decoded field by field, never unpickled (torch's
``all_gather_object`` would unpickle whatever a peer sent). The decoded states have the
shapes ``random.getstate()``, ``torch.get_rng_state()`` and ``numpy.random.get_state()``
return, so snapshots keep their format.
"""

from __future__ import annotations

import random
import struct
from typing import Any

# Capacities: torch's CPU generator (mt19937) is 5056 bytes and CUDA's (philox) 16; room
# is left for a torch that grows them. A state that does not fit is refused, not cut.
_TORCH_BYTES = 8192
_CUDA_BYTES = 256
_MT_WORDS = 624
_HEADER = struct.Struct("<4sIIII")  # magic, flags, torch bytes, cuda bytes, python version
_PYTHON = struct.Struct(f"<{_MT_WORDS + 1}Id")  # the words and position, gauss_next
_NUMPY = struct.Struct(f"<{_MT_WORDS}IIId")  # key, pos, has_gauss, cached_gaussian
_MAGIC = b"EMR1"
_CUDA, _NUMPY_SET, _GAUSS = 1, 2, 4
SIZE = _HEADER.size + _PYTHON.size + _TORCH_BYTES + _CUDA_BYTES + _NUMPY.size


def current() -> dict[str, Any]:
    """This process's random states, as ``State`` saves them."""
    import torch

    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()  # this rank's device (dropout)
    try:
        import numpy

        rng["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return rng


def apply(rng: dict[str, Any]) -> None:
    """Set this process's random states from ``current()``'s (or a decoded) dict."""
    import torch

    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if "numpy" in rng:
        import numpy

        numpy.random.set_state(rng["numpy"])


def _padded(name: str, data: bytes, capacity: int) -> bytes:
    if len(data) > capacity:
        raise RuntimeError(f"this torch's {name} random state is {len(data)} bytes, more "
                           f"than the {capacity} elastic_magic commits: report it")
    return data + bytes(capacity - len(data))


def encode(rng: dict[str, Any]) -> bytes:
    """``rng`` as ``SIZE`` bytes."""
    version, words, gauss = rng["python"]
    torch_state = bytes(rng["torch"].numpy().tobytes())
    cuda_state = bytes(rng["cuda"].numpy().tobytes()) if "cuda" in rng else b""
    flags = (_CUDA if "cuda" in rng else 0) | (_GAUSS if gauss is not None else 0)
    numpy_part = bytes(_NUMPY.size)
    if "numpy" in rng:
        kind, key, pos, has_gauss, cached = rng["numpy"]
        if kind != "MT19937":
            raise RuntimeError(f"numpy's global generator is {kind}: State saves MT19937")
        flags |= _NUMPY_SET
        numpy_part = _NUMPY.pack(*(int(k) for k in key), int(pos), int(has_gauss),
                                 float(cached))
    return b"".join([
        _HEADER.pack(_MAGIC, flags, len(torch_state), len(cuda_state), version),
        _PYTHON.pack(*words, 0.0 if gauss is None else gauss),
        _padded("CPU", torch_state, _TORCH_BYTES), _padded("CUDA", cuda_state, _CUDA_BYTES),
        numpy_part])


def decode(blob: bytes) -> dict[str, Any]:
    """What ``encode`` wrote; a blob of another length or magic is refused."""
    import torch

    if len(blob) != SIZE:
        raise ValueError(f"a random-state record of {len(blob)} bytes, not {SIZE}")
    magic, flags, torch_len, cuda_len, version = _HEADER.unpack_from(blob, 0)
    if magic != _MAGIC or torch_len > _TORCH_BYTES or cuda_len > _CUDA_BYTES:
        raise ValueError("not a random-state record")
    at = _HEADER.size
    *words, gauss = _PYTHON.unpack_from(blob, at)
    at += _PYTHON.size
    rng: dict[str, Any] = {
        "python": (version, tuple(words), gauss if flags & _GAUSS else None),
        "torch": torch.frombuffer(bytearray(blob[at:at + torch_len]), dtype=torch.uint8)}
    at += _TORCH_BYTES
    if flags & _CUDA:
        rng["cuda"] = torch.frombuffer(bytearray(blob[at:at + cuda_len]), dtype=torch.uint8)
    at += _CUDA_BYTES
    if flags & _NUMPY_SET:
        import numpy

        *key, pos, has_gauss, cached = _NUMPY.unpack_from(blob, at)
        rng["numpy"] = ("MT19937", numpy.array(key, dtype=numpy.uint32), pos, has_gauss,
                        cached)
    return rng


def gather(dist: Any) -> list[dict[str, Any]]:
    """Every rank's ``current()`` states, in rank order (a collective: every rank calls it).
    Also waits until every rank has finished its step."""
    import torch

    mine = torch.frombuffer(bytearray(encode(current())), dtype=torch.uint8)
    device = collective_device(dist)
    parts = [torch.empty(SIZE, dtype=torch.uint8, device=device)
             for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine.to(device))
    return [decode(part.cpu().numpy().tobytes()) for part in parts]


def collective_device(dist: Any) -> Any:
    """Where the default group's collectives take their tensors: NCCL only CUDA ones."""
    import torch

    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
