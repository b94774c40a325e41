"""Strangers at a live rank's mesh port: refused, logged, and the mesh works on.

Two real mesh processes bootstrap through a real TCPStore, the way the
engine's ranks do through the coordinator's store: rank 0 publishes its
mesh address under ``ctl/0`` and accepts. Before rank 1 starts, the test
reads that key and connects to the port as a stranger: with garbage, with
a proof made with the wrong token, and saying nothing. Rank 0 must close
each, log one warning naming the address and the reason, and then accept
rank 1 and exchange correct results with it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hora_native.mesh_handshake import MAGIC, NONCE_BYTES, proof

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

PEER = Path(__file__).with_name("mesh_peer.py")
TOKEN = "the-real-job-token"
HANDSHAKE_S = 2.0
ROUNDS = 3


def start_rank(port: int, rank: int, gated: bool = False) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, str(PEER), str(port), str(rank), "2", TOKEN, str(HANDSHAKE_S),
         str(ROUNDS), *(["gate"] if gated else [])], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def closed_by_peer(conn: socket.socket, within: float) -> bool:
    """Whether the other end closes ``conn`` within ``within`` seconds (reading all it sends)."""
    conn.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if not conn.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def test_strangers_are_refused_and_logged_and_the_mesh_works_on():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    rank0 = start_rank(store.port, 0)
    rank1 = None
    ports: dict[str, int] = {}
    try:
        host, port = store.get("ctl/0").decode().rsplit(":", 1)
        address = (host, int(port))

        garbage = socket.create_connection(address, timeout=5)
        ports["garbage"] = garbage.getsockname()[1]
        garbage.sendall(b"GET / HTTP/1.0\r\n\r\n" + secrets.token_bytes(100))
        assert closed_by_peer(garbage, 10), "rank 0 kept a connection that sent garbage"

        # Well-formed, claiming rank 1, but MAC'd with another token.
        forger = socket.create_connection(address, timeout=5)
        ports["forger"] = forger.getsockname()[1]
        challenge = b""
        while len(challenge) < len(MAGIC) + NONCE_BYTES:
            challenge += forger.recv(len(MAGIC) + NONCE_BYTES - len(challenge))
        assert challenge.startswith(MAGIC)
        nonce_a, nonce_c = challenge[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
        mac = proof("a-guessed-token", b"connect", "job-a/gen-1/", 2, 1, 0, nonce_a, nonce_c)
        forger.sendall(MAGIC + (1).to_bytes(4, "little", signed=True) + nonce_c + mac)
        assert closed_by_peer(forger, 10), "rank 0 accepted a proof made with the wrong token"

        silent = socket.create_connection(address, timeout=5)
        ports["silent"] = silent.getsockname()[1]
        started = time.monotonic()
        assert closed_by_peer(silent, HANDSHAKE_S + 10), "a silent stranger was never dropped"
        assert time.monotonic() - started >= HANDSHAKE_S - 0.5

        # A stranger still silent when the real rank 1 comes must not delay it.
        # Rank 1 starts first and connects when told, so that the stranger is
        # still within its 2 s when rank 1 arrives however long Python takes to start.
        rank1 = start_rank(store.port, 1, gated=True)
        store.wait(["ready/1"])
        lurker = socket.create_connection(address, timeout=5)
        ports["lurker"] = lurker.getsockname()[1]
        store.set("go/1", "1")
        outs = []
        for proc in (rank0, rank1):
            stdout, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"rank failed:\n{stdout}\n{stderr}"
            outs.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
        assert closed_by_peer(lurker, 5), "rank 0 left a stranger's connection open"
    finally:
        for proc in (rank0, rank1):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()

    for result, _stderr in outs:
        assert len(result["rounds"]) == ROUNDS
        for round_, got in enumerate(result["rounds"]):
            assert got["values"] == [[round_], [10 + round_]]
            assert got["sums"] == [1000 * round_, 1000 * (1 + round_)]
    log = outs[0][1]
    refusals = [line for line in log.splitlines() if "refused a connection from" in line]
    assert len(refusals) == 4, log
    assert f"127.0.0.1:{ports['garbage']}: did not speak the hora mesh" in log
    assert f"127.0.0.1:{ports['forger']}: claimed rank 1 with a wrong proof" in log
    assert f"127.0.0.1:{ports['silent']}: sent no valid proof within 2 s" in log
    assert f"127.0.0.1:{ports['lurker']}: still proving itself" in log
    assert TOKEN not in log and "a-guessed-token" not in log
