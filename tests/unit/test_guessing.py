"""The wrong-token budget per address (issue 25): refills, spares proven connections,
and keeps bounded tables whatever the number of addresses."""

from __future__ import annotations

from hora_coordinator.guessing import GuessLimiter, address_of_peer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_limited_after_its_burst_and_refills_at_its_rate():
    clock = Clock()
    limiter = GuessLimiter(burst=3, per_s=0.5, clock=clock)
    for _ in range(3):
        assert limiter.admits("10.0.0.9", "10.0.0.9:1")
        limiter.failed("10.0.0.9", "10.0.0.9:1")
    assert limiter.limited("10.0.0.9") and not limiter.admits("10.0.0.9", "10.0.0.9:2")
    assert not limiter.limited("10.0.0.8")  # other addresses are not
    clock.now = 1.9
    assert limiter.limited("10.0.0.9")
    clock.now = 2.0  # one more guess after 1 / per_s seconds
    assert not limiter.limited("10.0.0.9")
    limiter.failed("10.0.0.9", "10.0.0.9:1")
    assert limiter.limited("10.0.0.9")


def test_a_proven_connection_keeps_working_until_it_sends_a_wrong_token():
    limiter = GuessLimiter(burst=1, per_s=0.001, clock=Clock())
    limiter.proved("10.0.0.9:1")
    limiter.failed("10.0.0.9", "10.0.0.9:2")
    assert limiter.admits("10.0.0.9", "10.0.0.9:1")
    assert not limiter.admits("10.0.0.9", "10.0.0.9:3")
    limiter.failed("10.0.0.9", "10.0.0.9:1")
    assert not limiter.admits("10.0.0.9", "10.0.0.9:1")


def test_tables_stay_bounded_under_many_addresses_and_connections():
    clock = Clock()
    limiter = GuessLimiter(burst=2, per_s=1.0, max_addresses=100, max_connections=50,
                           clock=clock)
    for i in range(10_000):
        limiter.failed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", f"c{i}")
        limiter.proved(f"p{i}")
        clock.now += 0.001
    assert len(limiter) <= 100 and len(limiter._proven) <= 50


def test_zero_burst_never_limits():
    limiter = GuessLimiter(burst=0, clock=Clock())
    for _ in range(100):
        limiter.failed("10.0.0.9", "10.0.0.9:1")
    assert limiter.admits("10.0.0.9", "10.0.0.9:2") and len(limiter) == 0


def test_peer_strings_name_their_address():
    assert address_of_peer("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert address_of_peer("ipv6:[::1]:5555") == "::1"
    assert address_of_peer("unix:/tmp/sock") == "unix:/tmp/sock"
