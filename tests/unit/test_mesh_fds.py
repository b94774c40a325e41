"""The mesh with more than 1,024 files open, and under a crowd of strangers at set-up.

``select()`` fails on descriptors of 1,024 and above (issue 25, finding 6:
533 strangers during set-up broke the mesh). Real loopback sockets, ranks in
threads of this process, strangers in a process of their own.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from hora_native import mesh_handshake as hs
from hora_native.mesh_handshake import MAX_PENDING, accept_peers, connect_peer
from hora_native.mesh_transport import MeshTransport

pytestmark = pytest.mark.timeout(90)

TOKEN = "job-token"
CTX = "job-a/gen-1/"
FILLER = 1100

# Opens N connections to PORT that never say a word, then holds them until stdin closes.
SILENT_CROWD = """
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        pass
print(len(held), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def many_files_open() -> Iterator[None]:
    """More than 1,024 descriptors open, so that every new socket gets one above."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FILLER + 512:
        pytest.skip(f"the hard limit on open files ({hard}) is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FILLER + 512), hard))
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(FILLER)]
    hs.refusals.clear()
    try:
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        hs.refusals.clear()


def sockets_open() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return count


def test_mesh_set_up_and_exchanges_work_on_descriptors_above_1024(many_files_open):
    store = dist.HashStore()
    meshes: list[MeshTransport | None] = [None] * 3
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            meshes[rank] = MeshTransport(store, rank, 3, timedelta(seconds=20), "127.0.0.1",
                                         shared_memory=False, token=TOKEN, context=CTX)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    ready = [m for m in meshes if m is not None]
    assert len(ready) == 3
    try:
        assert min(conn.fileno() for m in ready for conn in m._peers.values()) >= 1024
        answers: list[object] = [None] * 3

        def exchange(rank: int) -> None:
            answers[rank] = [values for values, _payload in ready[rank].exchange([rank, 7])]

        threads = [threading.Thread(target=exchange, args=(r,)) for r in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert answers == [[[0, 7], [1, 7], [2, 7]]] * 3
    finally:
        for mesh in ready:
            mesh.close()


def test_a_crowd_of_silent_strangers_holds_a_bounded_number_of_sockets(many_files_open):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)  # the crowd queues at once instead of retrying its SYNs
    port = listener.getsockname()[1]
    result: dict[str, object] = {}

    def accept() -> None:
        try:
            result["peers"] = accept_peers(listener, TOKEN, CTX, 2, 0, {1},
                                           time.monotonic() + 40, handshake_timeout=30)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    baseline = sockets_open()
    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    crowd = subprocess.Popen([sys.executable, "-c", SILENT_CROWD, str(port), "400"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert crowd.stdout is not None
        connected = int(crowd.stdout.readline())
        assert connected > 3 * MAX_PENDING, connected
        time.sleep(0.5)  # the acceptor takes in what is queued
        # The acceptor holds at most MAX_PENDING of them (plus its listener).
        held = sockets_open() - baseline
        assert MAX_PENDING // 2 <= held <= MAX_PENDING + 1, held
        # A real rank still gets in, through the crowd, and the sockets work.
        conn = connect_peer(("127.0.0.1", port), TOKEN, CTX, 2, 1, 0, timeout=30)
        acceptor.join(30)
        assert "error" not in result, result
        peers = result["peers"]
        assert isinstance(peers, dict) and set(peers) == {1}
        assert peers[1].fileno() >= 1024
        conn.sendall(b"ping")
        assert peers[1].recv(4) == b"ping"
        conn.close()
        peers[1].close()
    finally:
        crowd.stdin.close()  # type: ignore[union-attr]
        crowd.wait(10)
        listener.close()
