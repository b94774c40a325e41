"""Unit tests of the per-job key-value store's limits (no server)."""

from __future__ import annotations

import pytest

from hora_coordinator.errors import InvalidRequestError
from hora_coordinator.store import KeyValueStore

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_a_long_key_is_refused_naming_its_start_its_length_and_the_limit():
    store = KeyValueStore("job", max_key_bytes=100)
    key = "rank/" + "k" * 200
    with pytest.raises(InvalidRequestError) as info:
        store.set(key, b"v")
    assert str(info.value) == (
        f"store key {key[:64]!r}… of 205 bytes in job 'job' is longer than the limit of 100 bytes"
    )
    with pytest.raises(InvalidRequestError, match="store key 'rank/kkk' of 8 bytes"):
        KeyValueStore("job", max_key_bytes=4).add("rank/kkk", 1)
    assert len(store) == 0


def test_add_and_compare_set_keep_the_value_limit():
    store = KeyValueStore("job", max_value_bytes=2)
    assert store.add("n", 99) == 99
    with pytest.raises(InvalidRequestError, match="store value of 3 bytes for key 'n'"):
        store.add("n", 1)  # 100 has three digits
    assert store.get_now("n") == b"99"
    with pytest.raises(InvalidRequestError, match="store value of 3 bytes"):
        store.compare_set("n", b"99", b"abc")
    assert store.compare_set("n", b"99", b"ab") == b"ab"
    assert store.compare_set("n", b"99", b"cd") == b"ab"
