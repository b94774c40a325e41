"""The mesh transport: small agreements (and their payloads) over direct TCP connections.

The engine's rounds agree on which cached tensors are ready with one small
MIN-reduction per round. Through Gloo that costs about 0.45 ms here, more
than the data allreduce of a small tensor; a direct exchange over
connections that stay open costs about one TCP round trip (60-100 us on
loopback). Every rank sends its vector to every other rank and reduces what
it receives, so the mesh suits small worlds: the engine uses it up to
:data:`MAX_MESH_SIZE` ranks and Gloo above that. :mod:`.mesh` builds the
mesh data plane on top of it.

A message may carry a payload after the vector: the engine sends the bytes
of the tensors it has ready with its vector, so that when every rank turns
out to be ready with the same tensors, the round has already moved the data
and a second exchange through Gloo is not needed (see :class:`.mesh.MeshBackend`). Sends and receives run concurrently on
non-blocking sockets, so payloads larger than the kernel's socket buffers
cannot deadlock two ranks that send to each other at once.

When every rank can open every other rank's files in ``/dev/shm`` (they run
on one machine), payloads do not travel over TCP at all: each rank writes
its payload into its own shared-memory segment and the message carries
only where it lies, so peers read the bytes in place at memory speed. Each
segment has two halves used in alternate exchanges: a peer may still be
reading exchange k's half while its owner writes exchange k+1's, but no
rank can reach exchange k+2 before every peer has finished exchange k.

:meth:`MeshTransport.swap` sends and receives between two ranks only (the
pairwise allreduce of :mod:`.mesh` is built on it). When the job spans
machines, the probe that decides on shared memory also finds which peers
share this rank's ``/dev/shm`` (:attr:`MeshTransport.local_peers`); swaps
with those go through a segment this rank keeps for each such peer.

The mesh bootstraps through the same store as the data plane: each rank
listens on an ephemeral port and publishes ``host:port``; lower ranks accept,
higher ranks connect. Every connection proves the job token both ways
before it carries anything (:mod:`.mesh_handshake`); the shared segments'
names come from the store and the authenticated connections only. Ranks
that share ``/dev/shm`` then move their connections onto Unix-domain
sockets, proving the token again (:mod:`.mesh_local`).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import BackendError
from .mesh_handshake import HANDSHAKE_TIMEOUT, accept_peers, connect_peer
from .mesh_local import connect_locally, probe_shared_memory
from .mesh_messages import _INLINE, _MESSAGE, _Incoming, _Outgoing
from .mesh_poll import SPIN_S, cores_for, ready_sockets
from .mesh_resident import FIRST_RESIDENT, RESIDENT_MIN_BYTES, ResidentBuffers
from .mesh_segments import Segment, at_least, peer_view, unlink
from .mesh_swaps import SwapSegments

__all__ = ["MAX_MESH_SIZE", "MeshTransport"]

_NONE: frozenset[int] = frozenset()

MAX_MESH_SIZE = 32

log = logging.getLogger("hora")

# Where segment files go unless the caller names a prefix (the engine does).
_DEFAULT_SHM_PREFIX = "/dev/shm/hora-mesh-"


class MeshTransport:
    """All-to-all exchange of small integer vectors between the ranks of a group.

    Args:
        store: the group's store (already prefixed with the generation).
        rank: this rank.
        size: number of ranks.
        timeout: the longest one exchange, or the set-up, may take.
        address: the interface to listen on.
        shared_memory: whether to use /dev/shm when every rank can.
        shm_prefix: the path every segment file of this mesh starts with (the
            engine names the job in it, so that the launcher can remove what
            a killed worker left behind).
        token: the job token; every connection proves it both ways
            (:mod:`.mesh_handshake`) and it never travels.
        context: names the job and generation; bound into every proof.
        handshake_timeout: the longest an accepted connection may take to
            prove itself.
        local_ranks: the ranks the launcher placed on this machine (the
            peers that share its ``/dev/shm`` count too, when more).

    Raises:
        ValueError: ``token`` is empty.
        BackendError: the set-up failed or timed out.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 address: str, shared_memory: bool = True,
                 shm_prefix: str = _DEFAULT_SHM_PREFIX, *, token: str, context: str = "",
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, local_ranks: int = 1) -> None:
        if not token:
            raise ValueError("the mesh needs the job token to authenticate its peers")
        self.rank = rank
        self.size = size
        self._peers: dict[int, socket.socket] = {}
        # Shared-memory transport: our segment (grown by replacing it with a
        # new version), the peers' segments we mapped, and a segment of ours
        # to unlink once every peer has opened it.
        self.shared = False
        self._shm_prefix = shm_prefix
        self._segment: Segment | None = None
        self._version = -1
        self._prefix = ""
        self._peer_prefix: dict[int, str] = {}
        self._peer_segments: dict[int, tuple[int, Segment]] = {}
        self._unlink_after: list[tuple[int, str]] = []
        self._exchanges = 0
        # Buffers peers read in place (shared-memory mode only), and the ranks
        # whose payload in the last exchange lay in one (see ``resident_ranks``).
        self._resident: ResidentBuffers | None = None
        self._resident_in: set[int] = set()  # (emptied by each exchange)
        #: The ranks (this one included) whose payload in the last exchange was
        #: a resident buffer (:mod:`.mesh_resident`): read in place, not copied.
        self.resident_ranks = _NONE
        #: Exchanges whose payload was a resident buffer of this rank (for tests).
        self.resident_sends = 0
        #: The peers whose message the exchange in progress still lacks
        #: (empty between exchanges); read by other threads to name the ranks
        #: a stalled exchange waits for.
        self.waiting_for: tuple[int, ...] = ()
        self._shm_refused = 1 << 62  # the smallest payload /dev/shm had no room for
        #: Peers whose /dev/shm this rank shares (both ways): on this machine.
        self.local_peers: frozenset[int] = frozenset()
        self._spin = False  # whether an exchange may spin (see ``exchange``)
        # Swaps with local peers: this rank's segments for them, and theirs mapped.
        self._swap_segments = SwapSegments(rank, shm_prefix)
        #: Bumped whenever a buffer that exchanged payloads lie in is replaced (our
        #: segment or a peer's, grown; a private buffer, grown): whoever keeps views
        #: of payloads drops them then, so that the old buffer can go.
        self.buffers_version = 0
        # abort() wakes an exchange blocked in select through this pair.
        self._aborted: str | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        seconds = timeout.total_seconds()
        deadline = time.monotonic() + seconds
        handshake_timeout = min(handshake_timeout, seconds)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((address, 0))
            listener.listen(size + 16)  # room for strangers refused meanwhile
            store.set(f"ctl/{rank}", f"{address}:{listener.getsockname()[1]}")
            for peer in range(rank):
                host, port = store.get(f"ctl/{peer}").decode().rsplit(":", 1)
                self._peers[peer] = connect_peer(
                    (host, int(port)), token, context, size, rank, peer,
                    max(0.0, deadline - time.monotonic()))
            self._peers.update(accept_peers(
                listener, token, context, size, rank, set(range(rank + 1, size)), deadline,
                handshake_timeout))
        except BackendError:  # a failed proof: its message names the peer already
            self.close()
            raise
        except (OSError, RuntimeError) as exc:
            self.close()
            raise BackendError(f"control mesh: rank {rank} of {size} could not connect: "
                               f"{exc}") from exc
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        for conn in self._peers.values():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
        self._timeout = seconds
        self._peer_of = {conn: peer for peer, conn in self._peers.items()}
        self._buffers: dict[int, torch.Tensor] = {}
        self._send: torch.Tensor | None = None
        if size > 1:
            try:
                found = probe_shared_memory(store, rank, size, self._peers, shm_prefix,
                                            shared_memory, self.exchange)
                self._prefix, self._peer_prefix = found.prefix, found.peer_prefix
                self.local_peers, self.shared = found.local_peers, found.shared
                if self.shared:
                    self._resident = ResidentBuffers(rank, self._prefix, self._peer_prefix)
                self._spin = cores_for(max(local_ranks, 1 + len(self.local_peers)))
                local = connect_locally(found, rank, size, self.exchange, token, context,
                                        deadline, handshake_timeout)
                for peer, conn in local.items():
                    conn.setblocking(False)
                    self._peers.pop(peer).close()
                    self._peers[peer] = conn
                self._peer_of = {conn: peer for peer, conn in self._peers.items()}
            except BaseException:  # no object to close them later: close the sockets now
                self.close()
                raise

    # -- shared memory --------------------------------------------------------

    def payload_buffer(self, nbytes: int) -> torch.Tensor:
        """Where to write the next exchange's payload (``nbytes``, uint8).

        In shared-memory mode this is the half of our segment that peers read
        in place; otherwise, or when the segment cannot grow that far (a full
        /dev/shm), a private buffer whose bytes go over TCP.
        """
        if self.shared and nbytes < self._shm_refused:
            try:
                return self._shared_buffer(nbytes)
            except OSError as exc:
                self._shm_refused = nbytes
                log.warning("rank %d: no room in %s for a %d byte payload (%s); payloads "
                            "this large go over the mesh's sockets instead", self.rank,
                            os.path.dirname(self._shm_prefix), nbytes, exc)
        grown = at_least(self._send, nbytes)
        if grown is not self._send:
            self._send = grown
            self.buffers_version += 1
        return grown[:nbytes]

    def _shared_buffer(self, nbytes: int) -> torch.Tensor:
        segment = self._segment
        if segment is None or segment.half < nbytes:
            # Grow geometrically; if there is no room for that, exactly.
            wanted = max(nbytes, 2 * segment.half if segment is not None else 1 << 20)
            for half in dict.fromkeys((wanted, nbytes)):
                self._version += 1
                path = f"{self._prefix}-{self.rank}-{self._version}"
                try:
                    grown = Segment(path, 2 * half, create=True)
                    break
                except OSError:
                    if half == nbytes:
                        raise
            if segment is not None:
                segment.close()  # peers keep their own mappings of it
            self._segment = segment = grown
            self.buffers_version += 1
            # Peers open the new file while receiving the next exchange; it
            # can go from the file system once the exchange after that is done.
            self._unlink_after.append((self._exchanges + 1, path))
        offset = (self._exchanges % 2) * segment.half
        return segment.region(offset, nbytes)

    def resident_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed buffer that peers read in place when it is a payload
        (:mod:`.mesh_resident`); None unless every rank shares this machine's
        /dev/shm, when it has no room, or below ``RESIDENT_MIN_BYTES``."""
        if self._resident is None or numel * dtype.itemsize < RESIDENT_MIN_BYTES:
            return None
        try:
            return self._resident.zeros(numel, dtype)
        except OSError as exc:
            log.warning("rank %d: no room in %s for a %d element resident buffer (%s); its "
                        "payloads are copied", self.rank, os.path.dirname(self._shm_prefix),
                        numel, exc)
            return None

    def holds_resident(self, payload: torch.Tensor) -> bool:
        """Whether ``payload`` lies in a resident buffer of this rank (None made: False)."""
        return self._resident is not None and self._resident.holds(payload)

    @property
    def has_resident(self) -> bool:
        """Whether this rank made a resident buffer (:meth:`resident_zeros`)."""
        return self._resident is not None and self._resident.made

    def _peer_payload(self, peer: int, version: int, offset: int, nbytes: int
                      ) -> torch.Tensor:
        if version <= FIRST_RESIDENT and self._resident is not None:
            self._resident_in.add(peer)
            return self._resident.peer_view(peer, version, offset, nbytes)
        path = f"{self._peer_prefix[peer]}-{peer}-{version}"
        mapped = self._peer_segments.get(peer)
        view = peer_view(self._peer_segments, self.rank, peer, version, path, "shared segment",
                         offset, nbytes)
        if self._peer_segments[peer] is not mapped:
            self.buffers_version += 1
        return view

    def min(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum of every rank's ``values`` (all ranks pass the same length).

        Raises:
            BackendError: a peer died, disagreed on the length, or the timeout passed.
        """
        result = list(values)
        for theirs, _payload in self.exchange(values):
            result = [a if a < b else b for a, b in zip(result, theirs, strict=True)]
        return result

    def exchange(self, values: Sequence[int], payload: torch.Tensor | None = None, *,
                 uniform: bool = True, spin: bool = False
                 ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Sends ``values`` and ``payload`` (uint8) to every peer; returns what each rank sent.

        The result is indexed by rank and includes this rank's own values and
        payload. A received payload is a view of a buffer the mesh reuses: it
        is valid until the next exchange. Every rank must pass a vector of
        the same length, unless ``uniform`` is False; payload lengths may differ.
        ``spin``: the caller's thread has nothing else to do, and may poll
        before it sleeps (:data:`~.mesh_poll.SPIN_S`), when this machine has a
        core for each of its ranks.

        Raises:
            BackendError: a peer died, disagreed on the length (or sent more
                values than any vector holds), or the timeout passed.
        """
        if self._aborted is not None:
            raise BackendError(f"control mesh: rank {self.rank}'s exchanges were aborted: "
                               f"{self._aborted}")
        n = len(values)
        nbytes = 0 if payload is None else payload.numel()
        segment = self._segment
        body: memoryview | None = None
        resident = self._resident.locate(payload) if \
            self._resident is not None and payload is not None and nbytes else None
        resident_in = self._resident_in
        resident_in.clear()
        if resident is not None:
            resident_in.add(self.rank)
            version, offset, named = resident
            head = _MESSAGE.pack(n, nbytes, offset, version)
            self.resident_sends += 1
            if named is not None:  # every peer has opened it after the next exchange
                self._unlink_after.append((self._exchanges + 1, named))
        elif payload is not None and nbytes and self.shared and segment is not None and \
                payload.untyped_storage().data_ptr() == segment.tensor.data_ptr():
            offset = payload.data_ptr() - segment.tensor.data_ptr()
            head = _MESSAGE.pack(n, nbytes, offset, self._version)
        else:
            head = _MESSAGE.pack(n, nbytes, 0, _INLINE)
            if payload is not None and nbytes:
                body = memoryview(payload.numpy())  # type: ignore[arg-type]
        head += struct.pack(f"<{n}q", *values)
        result: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * self.size
        result[self.rank] = (list(values), payload if nbytes else None)
        sending = {peer: _Outgoing(conn, head, body) for peer, conn in self._peers.items()}
        receiving = {peer: _Incoming(self, peer, n if uniform else None)
                     for peer in self._peers}
        for peer, message in self._transfer(sending, receiving, spin and self._spin).items():
            result[peer] = message
        self.resident_ranks = frozenset(resident_in) if resident_in else _NONE
        self._exchanges += 1
        while self._unlink_after and self._exchanges > self._unlink_after[0][0]:
            unlink(self._unlink_after.pop(0)[1])
        return result

    def swap(self, peer: int, payload: torch.Tensor) -> torch.Tensor:
        """Sends ``payload`` (uint8, contiguous) to ``peer`` while receiving what it sends.

        Only ``peer`` takes part: the two ranks must call it in the same order
        relative to their other exchanges with each other. With a peer on
        this machine (:attr:`local_peers`) the bytes go through a segment in
        /dev/shm that this rank keeps for that peer (apart from the one
        :meth:`exchange` uses), and only where they lie travels over the socket.

        Returns:
            The peer's payload, a view of a buffer the mesh reuses (or of the
            peer's segment): valid until the next exchange or swap with that
            peer.

        Raises:
            BackendError: the peer died, or the timeout passed.
        """
        if self._aborted is not None:
            raise BackendError(f"control mesh: rank {self.rank}'s exchanges were aborted: "
                               f"{self._aborted}")
        nbytes = payload.numel()
        head = _MESSAGE.pack(0, nbytes, 0, _INLINE)
        body = memoryview(payload.numpy()) if nbytes else None  # type: ignore[arg-type]
        if nbytes and peer in self.local_peers:
            located = self._swap_segments.buffer(peer, nbytes, self._prefix)
            if located is not None:
                buffer, offset, version = located
                buffer.copy_(payload)
                head, body = _MESSAGE.pack(0, nbytes, offset, version), None
        segments = self._swap_segments
        incoming = _Incoming(self, peer, 0, lambda peer, version, offset, nbytes: (
            segments.peer_payload(peer, version, offset, nbytes, self._peer_prefix[peer])))
        got = self._transfer({peer: _Outgoing(self._peers[peer], head, body)},
                             {peer: incoming})[peer][1]
        segments.swapped(peer)
        return got if got is not None else payload[:0]

    @property
    def shared_swaps(self) -> int:
        """Swaps whose payload went through shared memory (for tests and benchmarks)."""
        return self._swap_segments.shared

    def _transfer(self, sending: dict[int, _Outgoing], receiving: dict[int, _Incoming],
                  spin: bool = False) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """Pushes every outgoing message and pulls every incoming one, concurrently, on
        non-blocking sockets; returns the incoming messages by peer. With ``spin``,
        the waits of its first ``SPIN_S`` do not sleep (:func:`.mesh_poll.ready_sockets`)."""
        result: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        deadline = time.monotonic() + self._timeout
        self.waiting_for = tuple(receiving)
        peer = -1  # the peer being served, for an error's message
        try:
            for peer in list(sending):
                if sending[peer].push():
                    del sending[peer]
            spin_until = time.perf_counter() + SPIN_S if spin else 0.0
            while sending or receiving:
                ready_in, ready_out = ready_sockets(
                    self._wake_r, [self._peers[p] for p in receiving],
                    [self._peers[p] for p in sending], deadline - time.monotonic(),
                    spin_until)
                if self._aborted is not None:
                    raise BackendError(
                        f"control mesh: rank {self.rank}'s exchange waiting for rank(s) "
                        f"{sorted(receiving) or sorted(sending)} was aborted: {self._aborted}")
                if not ready_in and not ready_out:
                    raise BackendError(
                        f"control mesh: rank {self.rank} heard nothing from rank(s) "
                        f"{sorted(receiving) or sorted(sending)} for {self._timeout:g} s")
                for conn in ready_out:
                    peer = self._peer_of[conn]
                    if sending[peer].push():
                        del sending[peer]
                for conn in ready_in:
                    peer = self._peer_of[conn]
                    if receiving[peer].pull(conn):
                        result[peer] = receiving.pop(peer).message()
                        self.waiting_for = tuple(receiving)
        except ConnectionError as exc:
            # A peer that exited with bytes of ours unread resets the connection.
            raise BackendError(
                f"control mesh exchange failed on rank {self.rank}: rank {peer}'s connection "
                f"broke ({exc}); it exited or closed the mesh while this rank waited for it"
            ) from exc
        except OSError as exc:
            raise BackendError(f"control mesh exchange failed on rank {self.rank}: {exc}") \
                from exc
        finally:
            self.waiting_for = ()
        return result

    def _buffer(self, peer: int, nbytes: int) -> torch.Tensor:
        """The reused receive buffer for ``peer``, ``nbytes`` long."""
        kept = self._buffers.get(peer)
        buf = at_least(kept, nbytes)
        if buf is not kept:
            self._buffers[peer] = buf
            self.buffers_version += 1
        return buf[:nbytes]

    def abort(self, reason: str) -> None:
        """Fails the exchange in progress, if any, and every later one, with ``reason``.

        Safe from any thread. The engine calls it when the generation fails
        (a lost peer, say): an exchange with a stopped peer would otherwise
        wait out the whole timeout, since the peer's sockets stay open.
        """
        if self._aborted is None:
            self._aborted = reason or "aborted"
        try:
            self._wake_w.send(b"!")
        except OSError:
            pass  # already woken (a full buffer), or closed

    def close(self) -> None:
        self.abort("the mesh is closed")
        peers, self._peers = self._peers, {}
        for conn in peers.values():
            try:
                conn.close()
            except OSError:
                pass
        for _exchange, path in self._unlink_after:
            unlink(path)
        self._unlink_after.clear()
        self._swap_segments.close()
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        for _version, segment in self._peer_segments.values():
            segment.close()
        self._peer_segments.clear()
        if self._resident is not None:
            self._resident.close()
        self._wake_r.close()
        self._wake_w.close()
