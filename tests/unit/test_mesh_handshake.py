"""The mesh handshake, both ways, over real loopback sockets in this process."""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time

import pytest

from hora_native import BackendError
from hora_native import mesh_handshake as hs
from hora_native.mesh_handshake import MAGIC, NONCE_BYTES, accept_peers, connect_peer, proof

pytestmark = pytest.mark.timeout(60)

TOKEN = "job-token"
CTX = "job-a/gen-3/"


@pytest.fixture(autouse=True)
def _fresh_rate_limit():
    hs.refusals.clear()
    yield
    hs.refusals.clear()


def listener() -> tuple[socket.socket, tuple[str, int]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, sock.getsockname()


class Acceptor(threading.Thread):
    """Rank ``rank`` accepting ``expected`` in a thread, with ``token``."""

    def __init__(self, sock, token=TOKEN, rank=0, size=3, expected=(1, 2), timeout=20.0,
                 handshake_timeout=1.0):
        super().__init__(daemon=True)
        self.args = (sock, token, CTX, size, rank, set(expected),
                     time.monotonic() + timeout, handshake_timeout)
        self.peers = None
        self.error = None
        self.start()

    def run(self):
        try:
            self.peers = accept_peers(*self.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc


def read_challenge(conn: socket.socket) -> bytes:
    got = b""
    while len(got) < len(MAGIC) + NONCE_BYTES:
        chunk = conn.recv(64)
        assert chunk, "closed before the challenge"
        got += chunk
    assert got.startswith(MAGIC)
    return got[len(MAGIC):]


def closed(conn: socket.socket, within: float = 5.0) -> bool:
    conn.settimeout(within)
    try:
        while True:
            if not conn.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_ranks_with_the_token_connect_and_the_sockets_work_both_ways():
    sock, address = listener()
    acceptor = Acceptor(sock)
    one = connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
    two = connect_peer(address, TOKEN, CTX, 3, 2, 0, 5.0)
    acceptor.join(10)
    assert acceptor.error is None and set(acceptor.peers) == {1, 2}
    acceptor.peers[2].setblocking(True)
    acceptor.peers[2].sendall(b"ping")
    assert two.recv(4) == b"ping"
    for conn in (one, two, *acceptor.peers.values(), sock):
        conn.close()


def test_the_acceptor_refuses_a_connector_with_another_token_and_logs_it(caplog):
    sock, address = listener()
    acceptor = Acceptor(sock, expected=(1,))
    with caplog.at_level(logging.WARNING, logger="hora"):
        with pytest.raises(ConnectionError):  # the acceptor closes without a reply
            connect_peer(address, "another-token", CTX, 3, 1, 0, 5.0)
        good = connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
        acceptor.join(10)
    assert acceptor.error is None and set(acceptor.peers) == {1}
    assert "claimed rank 1 with a wrong proof" in caplog.text
    assert "refused a connection from 127.0.0.1:" in caplog.text
    good.close()
    acceptor.peers[1].close()
    sock.close()


def test_a_unix_domain_listener_refuses_a_stranger_and_takes_the_rank(caplog, tmp_path):
    """Ranks of one machine connect again over a Unix-domain socket: the same proof."""
    path = str(tmp_path / "rank0.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(16)
    acceptor = Acceptor(sock, expected=(1,))
    with caplog.at_level(logging.WARNING, logger="hora"):
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect(path)
        read_challenge(stranger)
        stranger.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)
        assert closed(stranger)
        with pytest.raises(ConnectionError):  # another job's token: closed without a reply
            connect_peer(path, "another-token", CTX, 3, 1, 0, 5.0)
        good = connect_peer(path, TOKEN, CTX, 3, 1, 0, 5.0)
        acceptor.join(10)
    assert acceptor.error is None and set(acceptor.peers) == {1}
    assert good.family == socket.AF_UNIX
    assert "refused a connection from a local socket: did not speak the hora mesh" in caplog.text
    assert "claimed rank 1 with a wrong proof" in caplog.text
    acceptor.peers[1].setblocking(True)
    acceptor.peers[1].sendall(b"ping")
    assert good.recv(4) == b"ping"
    with pytest.raises(FileNotFoundError, match="could not connect to rank 0's mesh port /"):
        connect_peer(str(tmp_path / "gone.sock"), TOKEN, CTX, 3, 1, 0, 5.0)
    for conn in (stranger, good, acceptor.peers[1], sock):
        conn.close()


def test_a_connector_whose_pause_overruns_the_deadline_raises_what_the_acceptor_did(
        monkeypatch):
    """A retry's pause that ends past the deadline (a loaded machine) leaves the
    refusal as the error, not a TimeoutError with no time left to connect."""

    class Clock:  # the module's time, whose sleeps overrun by 0.5 s
        offset = 0.0

        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + Clock.offset

        @staticmethod
        def sleep(seconds: float) -> None:
            time.sleep(seconds)
            Clock.offset += 0.5

    sock, address = listener()
    acceptor = Acceptor(sock, expected=(1,))
    monkeypatch.setattr(hs, "time", Clock)
    with pytest.raises(ConnectionError):  # another job's token: closed without a reply
        connect_peer(address, "another-token", CTX, 3, 1, 0, 0.3)
    monkeypatch.undo()
    good = connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
    acceptor.join(10)
    assert acceptor.error is None and set(acceptor.peers) == {1}
    good.close()
    acceptor.peers[1].close()
    sock.close()


def test_the_connector_refuses_an_acceptor_without_the_token():
    """An impostor at a rank's address that answers every proof with its own MAC."""
    sock, address = listener()

    def impostor():
        conn, _ = sock.accept()
        nonce_a = secrets.token_bytes(NONCE_BYTES)
        conn.sendall(MAGIC + nonce_a)
        data = b""
        while len(data) < len(MAGIC) + 4 + 2 * NONCE_BYTES:
            data += conn.recv(256)
        nonce_c = data[len(MAGIC) + 4:len(MAGIC) + 4 + NONCE_BYTES]
        conn.sendall(proof("not-the-job-token", b"accept", CTX, 3, 1, 0, nonce_a, nonce_c))
        time.sleep(0.5)
        conn.close()

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(BackendError, match="failed the job token proof"):
        connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
    thread.join(5)
    sock.close()


def test_the_connector_refuses_something_that_is_not_a_mesh():
    sock, address = listener()

    def http_server():
        conn, _ = sock.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 40)
        time.sleep(0.5)
        conn.close()

    thread = threading.Thread(target=http_server, daemon=True)
    thread.start()
    with pytest.raises(BackendError, match="did not answer as a hora mesh"):
        connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
    thread.join(5)
    sock.close()


def test_a_replayed_proof_is_refused():
    """A proof recorded from a real handshake is worth nothing in another one."""
    sock, address = listener()
    acceptor = Acceptor(sock, expected=(1,))
    # Record rank 1's proof by acting as its acceptor once (the token never travels).
    spy, spy_address = listener()
    recorded = []

    def record():
        conn, _ = spy.accept()
        conn.sendall(MAGIC + secrets.token_bytes(NONCE_BYTES))
        data = b""
        while len(data) < len(MAGIC) + 4 + NONCE_BYTES + 32:
            data += conn.recv(256)
        recorded.append(data)
        conn.close()

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    with pytest.raises((ConnectionError, BackendError, OSError)):
        connect_peer(spy_address, TOKEN, CTX, 3, 1, 0, 5.0)
    thread.join(5)
    assert TOKEN.encode() not in recorded[0]
    replay = socket.create_connection(address, timeout=5)
    read_challenge(replay)
    replay.sendall(recorded[0])
    assert closed(replay), "the acceptor took a replayed proof"
    good = connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
    acceptor.join(10)
    assert acceptor.error is None and set(acceptor.peers) == {1}
    for conn in (good, replay, spy, sock, *acceptor.peers.values()):
        conn.close()


def test_a_proof_binds_the_ranks_the_job_and_the_generation():
    a, c = secrets.token_bytes(NONCE_BYTES), secrets.token_bytes(NONCE_BYTES)
    base = proof(TOKEN, b"connect", CTX, 3, 1, 0, a, c)
    assert base == proof(TOKEN, b"connect", CTX, 3, 1, 0, a, c)
    others = [
        proof(TOKEN, b"connect", CTX, 3, 2, 0, a, c),  # another connector rank
        proof(TOKEN, b"connect", CTX, 3, 1, 2, a, c),  # another acceptor
        proof(TOKEN, b"connect", "job-a/gen-4/", 3, 1, 0, a, c),  # another generation
        proof(TOKEN, b"connect", "job-b/gen-3/", 3, 1, 0, a, c),  # another job
        proof(TOKEN, b"connect", CTX, 4, 1, 0, a, c),  # another world size
        proof(TOKEN, b"accept", CTX, 3, 1, 0, a, c),  # the other direction
        proof(TOKEN, b"connect", CTX, 3, 1, 0, c, a),  # other nonces
        proof("other", b"connect", CTX, 3, 1, 0, a, c),  # another token
    ]
    assert base not in others and len(set(others)) == len(others)


def test_a_valid_proof_for_a_rank_already_connected_is_refused():
    sock, address = listener()
    acceptor = Acceptor(sock, expected=(1, 2))
    first = connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
    with pytest.raises(ConnectionError):
        connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
    second = connect_peer(address, TOKEN, CTX, 3, 2, 0, 5.0)
    acceptor.join(10)
    assert acceptor.error is None and set(acceptor.peers) == {1, 2}
    for conn in (first, second, sock, *acceptor.peers.values()):
        conn.close()


def test_a_silent_stranger_is_dropped_at_its_deadline_and_delays_no_rank(caplog):
    sock, address = listener()
    acceptor = Acceptor(sock, expected=(1, 2), handshake_timeout=1.0)
    with caplog.at_level(logging.WARNING, logger="hora"):
        silent = socket.create_connection(address, timeout=5)
        started = time.monotonic()
        one = connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
        assert time.monotonic() - started < 0.9, "a silent stranger delayed rank 1"
        assert closed(silent, 5.0)
        assert time.monotonic() - started >= 0.9
        lurker = socket.create_connection(address, timeout=5)
        two = connect_peer(address, TOKEN, CTX, 3, 2, 0, 5.0)
        acceptor.join(10)
    assert acceptor.error is None and set(acceptor.peers) == {1, 2}
    assert closed(lurker, 2.0), "a stranger's connection outlived the set-up"
    assert "sent no valid proof within 1 s" in caplog.text
    assert "still proving itself when every rank had connected" in caplog.text
    for conn in (one, two, silent, lurker, sock, *acceptor.peers.values()):
        conn.close()


def test_repeated_refusals_from_one_host_are_counted_not_logged_one_by_one(caplog):
    sock, address = listener()
    acceptor = Acceptor(sock, expected=(1,))
    with caplog.at_level(logging.WARNING, logger="hora"):
        for _ in range(5):
            stranger = socket.create_connection(address, timeout=5)
            stranger.sendall(b"\x00" * 200)
            assert closed(stranger)
            stranger.close()
        good = connect_peer(address, TOKEN, CTX, 3, 1, 0, 5.0)
        acceptor.join(10)
    assert caplog.text.count("did not speak the hora mesh handshake") == 1
    good.close()
    acceptor.peers[1].close()
    sock.close()


def test_the_acceptor_gives_up_at_the_set_up_deadline():
    sock, _address = listener()
    acceptor = Acceptor(sock, expected=(1,), timeout=0.5)
    acceptor.join(10)
    assert isinstance(acceptor.error, TimeoutError) and "[1]" in str(acceptor.error)
    sock.close()


def test_a_failed_connect_names_the_peer_and_its_address():
    sock, address = listener()
    sock.close()  # nobody listens there any more
    with pytest.raises(OSError, match=rf"could not connect to rank 0's mesh port "
                                      rf"127.0.0.1:{address[1]}: "):
        connect_peer(address, TOKEN, CTX, 2, 1, 0, 2.0)
    with pytest.raises(TimeoutError, match=r"no time was left to connect to rank 0's mesh port"):
        connect_peer(address, TOKEN, CTX, 2, 1, 0, 0.0)
