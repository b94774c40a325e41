"""The pure parts of issue 25's bounds: connection gate, Host check, outbox, store quota."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hora_coordinator.connections import ConnectionGate
from hora_coordinator.errors import ResourceExhaustedError
from hora_coordinator.http_guard import is_loopback_host
from hora_coordinator.outbox import STREAM_END, Outbox
from hora_coordinator.store import KeyValueStore
from hora_proto.refusals import RefusalLog

pytestmark = pytest.mark.unit


def test_gate_caps_per_address_and_in_total():
    gate = ConnectionGate(total=3, per_address=2)
    a1, a2 = gate.admit("10.0.0.1"), gate.admit("10.0.0.1")
    assert "per_address" in gate.admit("10.0.0.1")
    b1 = gate.admit("10.0.0.2")
    assert "max_http_connections" in gate.admit("10.0.0.3")
    for ticket in (a1, a1, a2, b1):  # releasing twice is harmless
        ticket.release()
    assert gate.count == 0 and gate.open_from("10.0.0.1") == 0
    assert not isinstance(gate.admit("10.0.0.3"), str)


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("localhost:8080", True), ("LOCALHOST", True),
    ("127.0.0.1:80", True), ("127.1.2.3", True), ("[::1]:9000", True), ("::1", True),
    ("app.localhost", True), ("evil.example", False), ("evil.example:8080", False),
    ("10.0.0.1", False), ("[2001:db8::1]:80", False), ("localhost.evil.example", False),
    ("", False),
])
def test_loopback_host(host, loopback):
    assert is_loopback_host(host) is loopback


def test_outbox_overflows_once_and_drops_what_it_held():
    async def run() -> tuple[list[int], int, bool]:
        dropped: list[int] = []
        box = Outbox(3)
        box.on_overflow(lambda: dropped.append(1))
        for i in range(10):
            box.put_nowait(i)
        size_after = box.qsize()
        box.put_nowait(STREAM_END)  # the end still goes in
        return dropped, size_after, box.get_nowait() is STREAM_END

    dropped, size_after, ended = asyncio.run(run())
    assert dropped == [1] and size_after == 0 and ended


def test_store_quota_counts_keys_and_bytes_through_writes_and_deletes():
    store = KeyValueStore("job", max_keys=2, max_bytes=20)
    store.set("a", b"12345")
    store.set("a", b"1234567")  # overwrite: same key count, bytes replaced
    assert store.size_bytes == 8
    store.set("b", b"1")
    with pytest.raises(ResourceExhaustedError, match="max_store_keys_per_job"):
        store.set("c", b"")
    with pytest.raises(ResourceExhaustedError, match="max_store_bytes_per_job"):
        store.set("b", b"x" * 12)
    assert store.get_now("b") == b"1"  # a refused write changes nothing
    store.delete("a")
    assert store.size_bytes == 2
    store.add("c", 5)
    assert len(store) == 2


def test_refusal_log_admit_counts_what_it_left_out():
    now = [0.0]
    log = RefusalLog(10.0, logging.getLogger("test"), clock=lambda: now[0])
    assert log.admit("k") == 0
    assert log.admit("k") is None and log.admit("k") is None
    now[0] = 11.0
    assert log.admit("k") == 2
