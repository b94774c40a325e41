"""The mesh's handshake: only ranks of this job and generation connect.

Any process that reaches a rank's mesh port could otherwise claim to be a
rank and write into its gradients. Each connection therefore starts with a
mutual challenge-response over the job token, which never travels:

1. The acceptor (the lower rank) sends :data:`MAGIC` and a fresh random
   nonce ``a``.
2. The connector answers with :data:`MAGIC`, its rank, a fresh nonce ``c``
   and ``HMAC-SHA256(token, "connect" | context | size | its rank |
   acceptor's rank | a | c)``.
3. The acceptor checks that MAC and answers with ``HMAC-SHA256(token,
   "accept" | ... | a | c)``, which the connector checks in turn.

``context`` names the job and the generation (the engine passes its store
prefix), so a proof is worth nothing for another rank, another pair of
nonces, another generation or another job. The engine always has a token:
the coordinator replaces an empty one by a random one, and a world of one,
the only world without a coordinator, has no mesh.

The acceptor handles every connection at once on non-blocking sockets
(through :mod:`selectors`, so descriptors above 1024 work), each with its
own deadline: a stranger that connects and says nothing is dropped at its
deadline without delaying the ranks. At most :data:`MAX_PENDING`
connections prove themselves at once; a newer one evicts the oldest, so a
flood of silent strangers holds a bounded number of sockets, and a real
rank whose connection was evicted connects again (:func:`connect_peer`
retries a connection the acceptor closed, until the set-up's deadline). Each refused connection is
closed and logged as one warning naming its address and the reason;
repeated refusals of the same kind from one host are counted, not logged
one by one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field

from hora_proto.refusals import RefusalLog

from .base import BackendError

__all__ = ["HANDSHAKE_TIMEOUT", "MAGIC", "MAX_PENDING", "Address", "accept_peers", "connect_peer",
           "describe", "proof"]

log = logging.getLogger("hora")

MAGIC = b"hora-mesh/1\n"
NONCE_BYTES = 32
#: The longest an accepted connection may take to prove itself (seconds).
HANDSHAKE_TIMEOUT = 10.0
#: The most accepted connections proving themselves at once; a newer one evicts the oldest.
MAX_PENDING = 64
# How long a connector waits before connecting again after the acceptor dropped it (s).
_RETRY_PAUSE = 0.05
# Acceptor to connector: magic, nonce a.
_CHALLENGE = struct.Struct(f"<{len(MAGIC)}s{NONCE_BYTES}s")
# Connector to acceptor: magic, connector's rank, nonce c, MAC.
_PROOF = struct.Struct(f"<{len(MAGIC)}si{NONCE_BYTES}s32s")
_REPLY_BYTES = 32
# How long repeated refusals of one kind from one host stay quiet (seconds).
_LOG_EVERY = 60.0


def proof(token: str, role: bytes, context: str, size: int, connector: int, acceptor: int,
          nonce_a: bytes, nonce_c: bytes) -> bytes:
    """The MAC one side sends; ``role`` is ``b"connect"`` or ``b"accept"``."""
    ctx = context.encode()
    message = b"".join([MAGIC, role, struct.pack("<I", len(ctx)), ctx,
                        struct.pack("<iii", size, connector, acceptor), nonce_a, nonce_c])
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


#: Where a rank's mesh listens: (host, port), or a Unix-domain socket's path.
Address = tuple[str, int] | str


def describe(address: Address) -> str:
    """``host:port``, or the path of a Unix-domain socket."""
    return address if isinstance(address, str) else f"{address[0]}:{address[1]}"


def connect_peer(address: Address, token: str, context: str, size: int, rank: int,
                 peer: int, timeout: float) -> socket.socket:
    """Connects to ``peer`` (a lower rank) and runs the connector's side of the handshake.

    Raises:
        OSError: the connection failed or timed out.
        BackendError: the other end is not ``peer`` of this job (it failed the proof).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _connect_once(address, token, context, size, rank, peer,
                                 deadline - time.monotonic())
        except ConnectionRefusedError:
            raise  # nobody listens there (any more): the peer is gone
        except ConnectionError:
            # Reset or closed during the handshake: strangers crowded the
            # acceptor's pending handshakes and evicted this one. Try again,
            # unless the pause would end past the deadline (a pause may
            # overrun: then this error, not "no time was left", is the answer).
            if time.monotonic() + _RETRY_PAUSE >= deadline:
                raise
            time.sleep(_RETRY_PAUSE)
            if time.monotonic() >= deadline:
                raise


def _open(address: Address, timeout: float) -> socket.socket:
    if not isinstance(address, str):
        return socket.create_connection(address, timeout=timeout)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(address)
    except BaseException:
        conn.close()
        raise
    return conn


def _connect_once(address: Address, token: str, context: str, size: int, rank: int,
                  peer: int, timeout: float) -> socket.socket:
    where = f"rank {peer}'s mesh port {describe(address)}"
    if timeout <= 0:
        raise TimeoutError(f"no time was left to connect to {where}")
    try:
        conn = _open(address, timeout)
    except OSError as exc:
        raise _naming(exc, f"could not connect to {where}") from exc
    try:
        magic, nonce_a = _CHALLENGE.unpack(_recv_exactly(conn, _CHALLENGE.size))
        if magic != MAGIC:
            raise BackendError(f"control mesh: {describe(address)}, published as rank "
                               f"{peer}'s mesh address, did not answer as a hora mesh")
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        mine = proof(token, b"connect", context, size, rank, peer, nonce_a, nonce_c)
        conn.sendall(_PROOF.pack(MAGIC, rank, nonce_c, mine))
        theirs = _recv_exactly(conn, _REPLY_BYTES)
        want = proof(token, b"accept", context, size, rank, peer, nonce_a, nonce_c)
        if not hmac.compare_digest(theirs, want):
            raise BackendError(f"control mesh: {describe(address)}, published as rank "
                               f"{peer}'s mesh address, failed the job token proof")
    except OSError as exc:
        conn.close()
        raise _naming(exc, f"handshake with {where} failed") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _naming(exc: OSError, what: str) -> OSError:
    """``exc`` again, of the same class, its message saying ``what`` (which peer)."""
    try:
        return type(exc)(f"{what}: {exc}")
    except TypeError:  # a class that wants other arguments
        return OSError(f"{what}: {exc}")


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = conn.recv(n)
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


@dataclass
class _Handshake:
    """One accepted connection that has not proved itself yet."""

    conn: socket.socket
    address: str
    deadline: float
    nonce: bytes
    got: bytearray = field(default_factory=bytearray)


def accept_peers(listener: socket.socket, token: str, context: str, size: int, rank: int,
                 expected: set[int], deadline: float,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT) -> dict[int, socket.socket]:
    """Accepts one proven connection from each rank of ``expected``.

    ``deadline`` (a monotonic time) bounds the whole set-up; each connection
    gets ``handshake_timeout`` seconds to prove itself. Connections that fail
    are closed and logged; connections still proving themselves when every
    rank has connected are closed too.

    Raises:
        TimeoutError: some rank of ``expected`` did not connect by ``deadline``.
        OSError: the listener failed.
    """
    listener.setblocking(False)
    peers: dict[int, socket.socket] = {}
    # Insertion-ordered: the first entry is the oldest, evicted when crowded.
    waiting: dict[socket.socket, _Handshake] = {}
    ready = selectors.DefaultSelector()
    ready.register(listener, selectors.EVENT_READ)
    try:
        while len(peers) < len(expected):
            now = time.monotonic()
            for hs in [hs for hs in waiting.values() if hs.deadline <= now]:
                _drop(ready, waiting, hs)
                _refuse(hs, "silent", f"sent no valid proof within {handshake_timeout:g} s")
            if now >= deadline:
                raise TimeoutError(f"rank(s) {sorted(expected - peers.keys())} did not "
                                   f"connect to rank {rank}'s mesh port in time")
            wake = min([deadline, *(hs.deadline for hs in waiting.values())])
            for key, _events in ready.select(max(0.0, wake - now)):
                conn = key.fileobj
                if conn is listener:
                    _accept_all(listener, ready, waiting, handshake_timeout)
                    continue
                if conn not in waiting:
                    continue  # evicted by a newer connection in this round
                hs = waiting[conn]
                peer = _read_proof(hs, token, context, size, rank, expected, peers)
                if peer is not None:
                    _drop(ready, waiting, hs)
                    if peer >= 0:
                        peers[peer] = hs.conn
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise
    finally:
        ready.close()
        for hs in waiting.values():
            _refuse(hs, "late", "still proving itself when every rank had connected")
    return peers


def _drop(ready: selectors.BaseSelector, waiting: dict[socket.socket, _Handshake],
          hs: _Handshake) -> None:
    """Stops watching ``hs`` (the caller closes it, or keeps it as a proven peer)."""
    del waiting[hs.conn]
    ready.unregister(hs.conn)


def _accept_all(listener: socket.socket, ready: selectors.BaseSelector,
                waiting: dict[socket.socket, _Handshake], handshake_timeout: float) -> None:
    while True:
        try:
            conn, addr = listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            # Out of descriptors, say: the pending connection stays queued in
            # the kernel; the next round of the loop tries again.
            refusals.refused(("", "accept"), f"control mesh: could not accept: {exc}")
            time.sleep(0.01)  # the listener stays readable: do not spin
            return
        if len(waiting) >= MAX_PENDING:
            oldest = next(iter(waiting.values()))
            _drop(ready, waiting, oldest)
            _refuse(oldest, "crowded", f"evicted: {MAX_PENDING} newer connections were "
                                       f"proving themselves")
        # A Unix-domain socket's connector has no address.
        where = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "a local socket"
        hs = _Handshake(conn, where, time.monotonic() + handshake_timeout,
                        secrets.token_bytes(NONCE_BYTES))
        try:
            conn.setblocking(False)
            # A fresh connection's send buffer takes these few bytes at once.
            if conn.send(_CHALLENGE.pack(MAGIC, hs.nonce)) != _CHALLENGE.size:
                raise OSError("the challenge did not fit the socket's buffer")
        except OSError as exc:
            _refuse(hs, "error", f"could not be sent a challenge: {exc}")
            continue
        waiting[conn] = hs
        ready.register(conn, selectors.EVENT_READ)


def _read_proof(hs: _Handshake, token: str, context: str, size: int, rank: int,
                expected: set[int], peers: dict[int, socket.socket]) -> int | None:
    """Reads what arrived; None while the proof is incomplete, -1 if refused, else the rank."""
    try:
        chunk = hs.conn.recv(_PROOF.size - len(hs.got))
    except BlockingIOError:
        return None
    except OSError as exc:
        _refuse(hs, "error", f"connection failed during the handshake: {exc}")
        return -1
    if not chunk:
        _refuse(hs, "closed", "closed the connection without a complete proof")
        return -1
    hs.got += chunk
    if len(hs.got) < len(MAGIC) and not MAGIC.startswith(bytes(hs.got)) or \
            len(hs.got) >= len(MAGIC) and hs.got[:len(MAGIC)] != MAGIC:
        _refuse(hs, "garbage", "did not speak the hora mesh handshake")
        return -1
    if len(hs.got) < _PROOF.size:
        return None
    _magic, peer, nonce_c, mac = _PROOF.unpack(bytes(hs.got))
    if not hmac.compare_digest(
            mac, proof(token, b"connect", context, size, peer, rank, hs.nonce, nonce_c)):
        _refuse(hs, "proof", f"claimed rank {peer} with a wrong proof (not this job's token, "
                             f"generation or rank)")
        return -1
    if peer not in expected or peer in peers:
        _refuse(hs, "rank", f"proved rank {peer}, which rank {rank} does not expect (now)")
        return -1
    reply = proof(token, b"accept", context, size, peer, rank, hs.nonce, nonce_c)
    try:
        if hs.conn.send(reply) != len(reply):
            raise OSError("the reply did not fit the socket's buffer")
    except OSError as exc:
        _refuse(hs, "error", f"could not be sent the reply: {exc}")
        return -1
    return peer


#: Refused connections, at most one warning per (host, kind) a minute.
refusals = RefusalLog(_LOG_EVERY, log)


def _refuse(hs: _Handshake, kind: str, reason: str) -> None:
    """Closes a connection that did not prove itself and logs it (rate-limited)."""
    try:
        hs.conn.close()
    except OSError:
        pass
    host = hs.address.rsplit(":", 1)[0]
    refusals.refused((host, kind), f"control mesh: refused a connection from {hs.address}: "
                                   f"{reason}")
