"""Which ranks of a mesh share this machine, and the Unix-domain sockets between them.

Once the mesh's ranks are connected over TCP (:mod:`.mesh_transport`), a
probe through ``/dev/shm`` tells each rank which peers share its machine
(:func:`probe_shared_memory`), and whether all of them do, in which case
payloads travel through shared segments. The connections between ranks of
one machine then move from loopback TCP onto Unix-domain sockets
(:func:`connect_locally`), where a message costs less; every one of them
proves the job token as over TCP (:mod:`.mesh_handshake`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .mesh_handshake import accept_peers, connect_peer
from .mesh_segments import unlink

__all__ = ["Locality", "connect_locally", "probe_shared_memory"]

log = logging.getLogger("hora")

# The longest path a Unix-domain socket may have (sun_path holds 108 bytes).
_UNIX_PATH_MAX = 108

#: One all-to-all exchange of the mesh: every rank's values, by rank.
Exchange = Callable[[Sequence[int]], Sequence[tuple[list[int], Any]]]


@dataclass(frozen=True)
class Locality:
    """What the probe found.

    Attributes:
        prefix: the path this rank's segment files (and socket) start with.
        peer_prefix: each peer's prefix, by rank.
        local_peers: the peers each of which can read this rank's files and
            whose files this rank can read (ranks on this machine, when the job
            spans several).
        shared: whether every rank can open every other rank's files: the same
            verdict on every rank.
    """

    prefix: str
    peer_prefix: dict[int, str]
    local_peers: frozenset[int]
    shared: bool


def probe_shared_memory(store: dist.Store, rank: int, size: int, peers: Iterable[int],
                        shm_prefix: str, wanted: bool, exchange: Exchange) -> Locality:
    """Finds which ranks can open each other's files in /dev/shm.

    Each rank writes a random token into a probe file and reads every peer's;
    one exchange gives every rank every rank's answers, so the verdict is the
    same everywhere. A rank that does not want shared memory takes part and
    says no.
    """
    token = uuid.uuid4().hex
    prefix = f"{shm_prefix}{token}"
    probe = f"{prefix}.probe"
    ok = 1 if wanted else 0
    try:
        if ok:
            with open(probe, "w", encoding="ascii") as f:
                f.write(token)
    except OSError:
        ok = 0
    store.set(f"shm/{rank}", f"{ok} {prefix} {token}")
    peer_prefix: dict[int, str] = {}
    seen = 0  # bit p: peer p's probe file is readable here
    try:
        for peer in peers:
            peer_ok, theirs, peer_token = store.get(f"shm/{peer}").decode().split(" ")
            peer_prefix[peer] = theirs
            if ok and peer_ok == "1":
                try:
                    with open(f"{theirs}.probe", encoding="ascii") as f:
                        if f.read() == peer_token:
                            seen |= 1 << peer
                except OSError:
                    pass
        answers = exchange([ok, seen])
    finally:
        unlink(probe)
    oks = [values[0] for values, _payload in answers]
    masks = [values[1] for values, _payload in answers]
    local = frozenset(peer for peer in peer_prefix
                      if masks[rank] >> peer & 1 and masks[peer] >> rank & 1)
    # From every rank's answers, so that every rank comes to the same verdict.
    shared = all(ok == 1 for ok in oks) and all(
        masks[a] >> b & 1 for a in range(size) for b in range(size) if a != b)
    return Locality(prefix, peer_prefix, local, shared)


def connect_locally(locality: Locality, rank: int, size: int, exchange: Exchange, token: str,
                    context: str, deadline: float, handshake_timeout: float
                    ) -> dict[int, socket.socket]:
    """Unix-domain connections to the local peers, by rank (a 64-byte round
    trip between two processes here: 9 µs, against 15 over loopback TCP).

    Every rank takes part in one exchange. A rank with a local peer above it
    listens at ``<its prefix>.sock`` (a path the job's ranks learnt from the
    store) and says whether it could; each local peer below one that could
    connects and proves the job token. A pair with no listener gets no entry:
    it stays on TCP.

    Raises:
        BackendError: a local peer failed the proof.
        OSError, TimeoutError: a connection failed or did not come in time.
    """
    higher = {peer for peer in locality.local_peers if peer > rank}
    path = f"{locality.prefix}.sock"
    listener: socket.socket | None = None
    if higher and len(path.encode()) < _UNIX_PATH_MAX:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            # Any local user may connect, as to the TCP port: the proof decides.
            os.chmod(path, 0o666)
            listener.listen(len(higher) + 16)
        except OSError as exc:
            log.info("rank %d: no Unix-domain socket at %s (%s): its local peers stay on TCP",
                     rank, path, exc)
            listener.close()
            listener = None
            unlink(path)
    local: dict[int, socket.socket] = {}
    try:
        listening = [values[0] for values, _payload in
                     exchange([0 if listener is None else 1])]
        for peer in sorted(locality.local_peers):
            if peer < rank and listening[peer]:
                local[peer] = connect_peer(
                    f"{locality.peer_prefix[peer]}.sock", token, context, size, rank, peer,
                    max(0.0, deadline - time.monotonic()))
        if listener is not None:
            local.update(accept_peers(listener, token, context, size, rank, higher, deadline,
                                      handshake_timeout))
    except BaseException:
        for conn in local.values():
            conn.close()
        raise
    finally:
        if listener is not None:
            listener.close()
            unlink(path)
    return local
