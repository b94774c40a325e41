"""What an attacker does to a coordinator, bounded, for tests/security.

Each helper has a deadline and cleans up what it opened.
"""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["HALF_GRPC", "HALF_HTTP", "half_header_flood", "healthz_within", "rss_bytes",
           "send_garbage"]

# A request head without its blank line: the server waits for the rest.
HALF_HTTP = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
# Half of the HTTP/2 client preface.
HALF_GRPC = b"PRI * HTTP/2.0\r\n"


@contextlib.contextmanager
def half_header_flood(targets: Sequence[tuple[str, int, bytes]], count: int,
                      source: str = "127.0.0.2", deadline_s: float = 30.0
                      ) -> Iterator[list[socket.socket]]:
    """Opens ``count`` connections to each ``(host, port, bytes)`` from ``source``,
    sends the bytes on each (ignoring connections the server already closed) and
    holds them open inside the block."""
    held: list[socket.socket] = []
    stop_at = time.monotonic() + deadline_s
    try:
        for host, port, data in targets:
            for _ in range(count):
                if time.monotonic() > stop_at:
                    raise TimeoutError(f"the flood did not open {count} connections in time")
                s = socket.socket()
                s.settimeout(2.0)
                s.bind((source, 0))
                held.append(s)
                try:
                    s.connect((host, port))
                    s.sendall(data)
                except OSError:
                    pass  # refused or closed at once: what a capped server does
        yield held
    finally:
        for s in held:
            s.close()


def healthz_within(url: str, timeout_s: float) -> float:
    """Seconds ``GET url/healthz`` took to answer 200.

    Raises:
        AssertionError: no 200 within ``timeout_s``.
    """
    started = time.monotonic()
    last: Exception | None = None
    while time.monotonic() - started < timeout_s:
        left = timeout_s - (time.monotonic() - started)
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=max(0.1, left)) as r:
                if r.status == 200:
                    return time.monotonic() - started
        except (OSError, urllib.error.URLError) as exc:
            last = exc
            time.sleep(0.05)
    raise AssertionError(f"/healthz did not answer within {timeout_s} s: {last!r}")


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def send_garbage(address: tuple[str, int], count: int) -> None:
    """``count`` connections that each send bytes no protocol accepts, read what
    comes back (briefly) and close."""
    for _ in range(count):
        with socket.create_connection(address, timeout=2) as s:
            s.sendall(b"\x16GARBAGE\r\n\r\n" * 8)
            with contextlib.suppress(OSError):
                s.recv(256)
