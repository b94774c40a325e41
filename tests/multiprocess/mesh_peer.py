"""One rank of a bare mesh, for the peer authentication tests: a real process.

Usage: mesh_peer.py STORE_PORT RANK SIZE TOKEN HANDSHAKE_TIMEOUT ROUNDS [gate]

With ``gate``, the rank sets ``ready/RANK`` in the store once it has started
and waits for ``go/RANK`` before it connects, so that a test can time its
connection to the moment it chooses.

Builds the mesh through a TCPStore, runs ROUNDS exchanges (a MIN and a
payload per round) and prints what it got as one JSON line; refusals go to
stderr through the "hora" logger.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from hora_native.mesh_transport import MeshTransport


def main() -> None:
    port, rank, size, token, handshake, rounds = sys.argv[1:7]
    gated = sys.argv[7:] == ["gate"]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    store = dist.TCPStore("127.0.0.1", int(port), is_master=False,
                          timeout=timedelta(seconds=60))
    if gated:
        store.set(f"ready/{rank}", "1")
        store.wait([f"go/{rank}"])
    mesh = MeshTransport(store, int(rank), int(size), timedelta(seconds=60), "127.0.0.1",
                         shared_memory=True, token=token, context="job-a/gen-1/",
                         handshake_timeout=float(handshake))
    out = []
    for round_ in range(int(rounds)):
        data = torch.full((1000,), int(rank) + round_, dtype=torch.uint8)
        buf = mesh.payload_buffer(data.numel())
        buf.copy_(data)
        got = mesh.exchange([int(rank) * 10 + round_], buf)
        out.append({"values": [v for v, _p in got],
                    "sums": [int(p.to(torch.int64).sum()) for _v, p in got]})
    print(json.dumps({"rank": int(rank), "shared": mesh.shared, "rounds": out}), flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
