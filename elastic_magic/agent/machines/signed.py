"""What the job's rendezvous store holds, signed with the job's key and verified before use.

torch's TCPStore has no authentication, and torch's handler unpickles the rendezvous state
it reads from it: whoever can write that key could run code in the kernel. So every value
an agent reads from the rendezvous store and acts on is signed with the job's rendezvous
key and verified first: the state through :class:`SignedBackend` (torch's c10d backend
underneath, so the c10d semantics hold), our own keys through :func:`put_signed` and
:func:`get_signed`. A value that fails verification is never unpickled or used: the job
ends with :class:`RendezvousRejected`.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

_VERSION = struct.Struct("!Q")
_MAC_BYTES = hashlib.sha256().digest_size

class RendezvousRejected(RendezvousStateError):
    """Something in the job's rendezvous store was not written by this job's agents.

    A RendezvousError, so torch's heartbeat thread logs it rather than dying with it; the
    agent learns of it from :attr:`Rendezvous.rejected`."""


def rendezvous_key(token: str) -> bytes:
    """The key a multi-node job signs its rendezvous store with: every machine of the job
    holds the join token, and nobody else does."""
    return hmac.new(token.encode(), b"elastic-magic rendezvous store", hashlib.sha256).digest()


def _mac(key: bytes, name: str, value: bytes) -> bytes:
    # The key's name is signed too: a value cannot be moved to another key.
    return hmac.new(key, name.encode() + b"\0" + value, hashlib.sha256).digest()


def _rejected(what: str, where: str) -> RendezvousRejected:
    return RendezvousRejected(
        f"unauthenticated rendezvous state rejected: {what} in the rendezvous store at "
        f"{where}. It was not written by this job's agents, so it was not used; someone "
        "who can reach that port wrote into the store, and the job was stopped. Keep the "
        "rendezvous endpoint on a private network (see the Security page of the docs, "
        "docs/explanation/security.md).")


def put_signed(store: Store, key: bytes, name: str, value: str, *, scope: str = "") -> None:
    """Set ``name`` to ``value`` with its MAC; ``scope`` (a run or round id) is signed with
    it, so the value is refused anywhere else."""
    mac = _mac(key, f"{scope}/{name}", value.encode())
    store.set(name, f"{mac.hex()} {value}")


def get_signed(store: Store, key: bytes, name: str, where: str, *, scope: str = "") -> str:
    """The value of ``name`` (waiting for it), verified; RendezvousRejected otherwise."""
    mac, _, value = store.get(name).partition(b" ")
    if not hmac.compare_digest(mac, _mac(key, f"{scope}/{name}", value).hex().encode()):
        raise _rejected(f"the value of {name!r} is not signed with this job's key", where)
    return value.decode()


class SignedBackend(RendezvousBackend):
    """torch's c10d backend, except that every state written is signed with the job's key
    and every state read is verified before torch's handler unpickles it.

    A stored state is ``version (8 bytes) | HMAC-SHA256 | torch's pickle`` (base64-encoded
    by the c10d backend, as before). Each write replaces the state it was based on
    (compare_set) with the next version, so versions only grow: an older state written
    back (a replay), a reset to "no state", or a deleted key is refused too."""

    def __init__(self, store: Store, run_id: str, key: bytes, where: str,
                 on_reject: Callable[[RendezvousRejected], None]) -> None:
        self._inner = C10dRendezvousBackend(store, run_id)
        self._store = store
        self._name = f"torch.rendezvous.{run_id}"  # the key torch's backend keeps it under
        self._key = key
        self._where = where
        self._on_reject = on_reject
        self._seen = 0  # the highest version read so far

    @property
    def name(self) -> str:
        return self._inner.name

    def get_state(self) -> tuple[bytes, Token] | None:
        # A get on a missing key would block until the store's timeout (a minute).
        if not self._store.check([self._name]):
            raise self._reject("the rendezvous state was deleted")
        try:
            found = self._inner.get_state()
        except RendezvousStateError:  # not even base64: not ours
            raise self._reject("the rendezvous state is not signed with this job's key") \
                from None
        if found is None:
            self._no_state()
            return None
        state, token = found
        return self._open(state), token

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        version = _VERSION.pack(self._seen + 1)
        sealed = version + _mac(self._key, self._name, version + state) + state
        try:
            found = self._inner.set_state(sealed, token)
        except RendezvousStateError:
            raise self._reject("the rendezvous state is not signed with this job's key") \
                from None
        if found is None:
            self._no_state()
            return None
        current, new_token, written = found
        return self._open(current), new_token, written

    def _open(self, sealed: bytes) -> bytes:
        version, mac = sealed[:_VERSION.size], sealed[_VERSION.size:_VERSION.size + _MAC_BYTES]
        state = sealed[_VERSION.size + _MAC_BYTES:]
        if len(mac) != _MAC_BYTES or not hmac.compare_digest(
                mac, _mac(self._key, self._name, version + state)):
            raise self._reject("the rendezvous state is not signed with this job's key")
        (number,) = _VERSION.unpack(version)
        if number < self._seen:
            raise self._reject("an older rendezvous state was written back")
        self._seen = number
        return state

    def _no_state(self) -> None:
        if self._seen:  # only the very first read may find no state
            raise self._reject("the rendezvous state was reset")

    def _reject(self, what: str) -> RendezvousRejected:
        error = _rejected(what, self._where)
        self._on_reject(error)
        return error
