"""The link between the kernel's agent (the head) and agents on other machines (nodes).

A node (``ELASTIC_MAGIC_TOKEN=T elastic-magic join HOST:PORT``) finds the hub's address in
the rendezvous store (signed with a key derived from the token, and verified), connects,
proves it knows the job's token and receives the job: run id, spec and payload. From then
on both sides exchange signed frames over that socket. The node forwards its ranks' output
and failures, proxies its workers' State requests (the head keeps the commits' catalog;
snapshot chunks cross in pieces, ``chunks.py``) and reports its results; the head
answers and tells nodes to stop.
Membership is not decided here: every agent follows torch's rendezvous.

Both sides send a :class:`Heartbeat` every ``--link-timeout``/4 seconds, and the socket
gets the kernel's receive and send timeouts (SO_RCVTIMEO, SO_SNDTIMEO) of ``--link-timeout``:
a link on which nothing arrives for that long (cut, or the other machine frozen) fails on
its reader, with no polling anywhere.

No frame is read before the peer has proved the token (a challenge-response on fixed-size
raw bytes), and each connection signs with its own key derived from the token and both
sides' nonces, so frames cannot be replayed on another connection. A link that fails (a
bad signature, a frame above the size limit) is closed and reported, never left hanging.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import secrets
import socket
import struct
import threading
from datetime import timedelta
from typing import Any

from ...wire.attach_messages import ToAgent, ToKernel
from ...wire.chunk_messages import ChunkPiece
from ...wire.link_messages import Heartbeat, JobOffer, LinkMessage
from ...wire.protocol import Channel
from ..inbox import FromLink, Inbox
from .chunks import ChunkSink

HUB_KEY = "elastic_magic/hub"  # in the rendezvous store: "host:port" of the hub
_NONCE_BYTES = 32
_MAC_BYTES = hashlib.sha256().digest_size
_HANDSHAKE_TIMEOUT = 10.0


class HubError(RuntimeError):
    """Joining failed: the hub cannot be reached, or the token was refused."""


def new_token() -> str:
    return secrets.token_hex(16)


def _proof(token: str, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token.encode(), role + server_nonce + client_nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise HubError("the other side closed the connection during the handshake")
        data += chunk
    return data


def challenge(sock: socket.socket, token: str, peer: str) -> bytes:
    """Server side of the handshake: the peer proves it knows ``token``, then so do we.
    Returns the connection's own signing key. Raises HubError (or OSError) otherwise."""
    sock.settimeout(_HANDSHAKE_TIMEOUT)
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(server_nonce)
    client_nonce = _recv_exact(sock, _NONCE_BYTES)
    proof = _recv_exact(sock, _MAC_BYTES)
    if not hmac.compare_digest(proof, _proof(token, b"node", server_nonce, client_nonce)):
        raise HubError(f"{peer}: wrong token")
    sock.sendall(_proof(token, b"head", server_nonce, client_nonce))
    sock.settimeout(None)
    return _proof(token, b"key", server_nonce, client_nonce)


def answer_challenge(sock: socket.socket, token: str, refused: str, unproven: str) -> bytes:
    """Client side of the handshake: prove ``token``, check the server knows it too.
    Returns the connection's signing key. Raises HubError with ``refused`` when the server
    closes on our proof, with ``unproven`` when its own proof is wrong."""
    sock.settimeout(_HANDSHAKE_TIMEOUT)
    server_nonce = _recv_exact(sock, _NONCE_BYTES)
    client_nonce = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(client_nonce + _proof(token, b"node", server_nonce, client_nonce))
    try:
        answer = _recv_exact(sock, _MAC_BYTES)
    except (HubError, OSError):
        raise HubError(refused) from None
    if not hmac.compare_digest(answer, _proof(token, b"head", server_nonce, client_nonce)):
        raise HubError(unproven)
    sock.settimeout(None)
    return _proof(token, b"key", server_nonce, client_nonce)


# What a link carries: between machines, and between a detached job's agent and kernels.
Frame = LinkMessage | ToKernel | ToAgent


class Link:
    """One authenticated connection; sends are serialised (several threads send)."""

    def __init__(self, sock: socket.socket, key: bytes, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._channel = Channel(sock.fileno(), key)
        self._lock = threading.Lock()
        self.timeout: float | None = None  # set by keep_alive
        self._closed = threading.Event()
        self._heart: threading.Thread | None = None

    def keep_alive(self, timeout: float) -> None:
        """Heartbeats every ``timeout``/4 s; a read or write that makes no progress for
        ``timeout`` seconds fails (the kernel's socket timeouts: nothing polls)."""
        self.timeout = timeout
        whole = int(timeout)
        limit = struct.pack("ll", whole, int((timeout - whole) * 1e6))
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self.sock.setsockopt(socket.SOL_SOCKET, option, limit)
        self._heart = threading.Thread(target=self._beat, args=(timeout / 4,),
                                       name=f"elastic-heartbeat-{self.peer}", daemon=True)
        self._heart.start()

    def _beat(self, interval: float) -> None:
        while not self._closed.wait(interval):
            if not self.send(Heartbeat()):
                return

    def send(self, message: Frame) -> bool:
        """False once the connection is gone (or closed here: its descriptor may already
        name another file)."""
        with self._lock:
            if self._closed.is_set():
                return False
            try:
                self._channel.send(message)
                return True
            except OSError:  # maybe mid-frame (a send timeout): nothing may follow it
                self.shutdown()
                return False

    def recv(self) -> Any:
        """The next frame, verified: a link's message, as the other side typed it."""
        return self._channel.recv()

    def shutdown(self) -> None:
        """Wakes its reader (it reads the end) and a send blocked on a full socket; the
        reader then closes it (a descriptor closed under a reader could be reused by
        another file before it reads again)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self.shutdown()
        heart = self._heart
        if heart is not None and heart is not threading.current_thread():
            heart.join(timeout=5)
        with self._lock:  # no send is using the descriptor any more
            self.sock.close()


def read_into(link: Link, node: int, inbox: Inbox, chunks: ChunkSink | None = None) -> None:
    """Put every message from ``link`` on ``inbox`` until it closes (run on a thread);
    snapshot chunks' pieces go straight into ``chunks`` (never queued on the heap), in
    order with the messages that follow them."""
    reason = None
    while True:
        try:
            message = link.recv()
        except (EOFError, ConnectionResetError):  # a reset: it died with data unread
            break
        except BlockingIOError:  # SO_RCVTIMEO: not even a heartbeat came
            reason = f"no heartbeat for {link.timeout:g}s (the link is cut, or the machine " \
                     "is frozen)"
            break
        except Exception as exc:  # told to the agent, never a reader thread dying unseen
            reason = str(exc) or type(exc).__name__
            break
        if isinstance(message, ChunkPiece) and chunks is not None:
            chunks.write(node, message)
        elif not isinstance(message, Heartbeat):
            inbox.put(FromLink(link, node, message))
    link.close()
    inbox.put(FromLink(link, node, None, reason))


class Hub:
    """Head side: accepts nodes on ``host`` (OS-assigned port), hands each the job, and
    puts their messages on the agent's inbox (``FromLink``)."""

    def __init__(self, host: str, token: str, job: JobOffer, inbox: Inbox) -> None:
        self.link_timeout = job.spec.link_timeout
        self.token = token
        self.job = job
        self.inbox = inbox
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.socket(family, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((host, 0))
        self._server.listen(16)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self.links: dict[int, Link] = {}
        self.chunks = ChunkSink()  # the other machines' chunks arriving
        self._handshaking: set[socket.socket] = set()  # closed with the hub, too
        self._ids = itertools.count(1)
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="elastic-hub", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"),
                             name="elastic-hub-node", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._handshaking.add(sock)
        try:
            link = self._handshake(sock, peer)
        except (HubError, OSError):
            sock.close()  # a peer without the token never reaches a frame
            return
        finally:
            with self._lock:
                self._handshaking.discard(sock)
        node = next(self._ids)
        with self._lock:
            if self._closed:
                link.close()
                return
            self.links[node] = link
        link.send(self.job)
        link.keep_alive(self.link_timeout)
        read_into(link, node, self.inbox, self.chunks)
        with self._lock:
            self.links.pop(node, None)

    def _handshake(self, sock: socket.socket, peer: str) -> Link:
        return Link(sock, challenge(sock, self.token, peer), peer)

    def linked(self) -> set[int]:
        """The connections open now (their handshake done)."""
        with self._lock:
            return set(self.links)

    def send_to(self, node: int, message: LinkMessage) -> None:
        with self._lock:
            link = self.links.get(node)
        if link is not None:
            link.send(message)

    def broadcast(self, message: LinkMessage) -> None:
        with self._lock:
            links = list(self.links.values())
        for link in links:
            link.send(message)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self.links.values())
            handshaking = list(self._handshaking)
        # close() alone would not wake the threads blocked in accept() or in a handshake
        # (which would keep the port listening, or wait out the handshake's timeout);
        # shutdown() does.
        for sock in [self._server, *handshaking]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for link in links:
            link.close()
        self.chunks.drop()


def connect(endpoint: str, token: str, timeout: float = 60.0) -> tuple[Link, JobOffer]:
    """Node side: find the hub through the rendezvous store at ``endpoint``, prove the
    token, and return the link and the job."""
    from torch.distributed import TCPStore

    from .rendezvous import RendezvousRejected, get_signed, rendezvous_key

    host, _, port = endpoint.rpartition(":")
    try:
        store = TCPStore(host.strip("[]"), int(port), is_master=False,
                         timeout=timedelta(seconds=timeout))
        hub = get_signed(store, rendezvous_key(token), HUB_KEY, endpoint)
    except RendezvousRejected:
        raise HubError(f"the job at {endpoint} refused the token: the hub's address there is "
                       "not signed with it. Copy the token again from the notebook (it "
                       "changes with every job); if it is right, someone else wrote into "
                       "the job's rendezvous store.") from None
    except (RuntimeError, ValueError) as exc:
        raise HubError(f"no elastic job is accepting machines at {endpoint}: {exc}. Start "
                       "the cell with --nnodes MIN:MAX --rdzv-endpoint HOST:PORT first.") from None
    hub_host, _, hub_port = hub.rpartition(":")
    sock = socket.create_connection((hub_host, int(hub_port)), timeout=_HANDSHAKE_TIMEOUT)
    try:
        key = answer_challenge(
            sock, token, f"the job at {endpoint} refused the token; copy the join command "
            "the cell printed (its token changes with every job).",
            f"the hub at {hub} could not prove it knows the token; refused")
        link = Link(sock, key, hub)
        job = link.recv()
    except BaseException:
        sock.close()
        raise
    if not isinstance(job, JobOffer):
        link.close()
        raise HubError(f"unexpected first message {type(job).__name__} from the hub")
    link.keep_alive(job.spec.link_timeout)  # the head's bound, on both sides
    return link, job
