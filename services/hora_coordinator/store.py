"""The per-job key-value store that bootstraps the data plane.

Waits are event-driven: a waiter parks on a future that the Set/Add/CompareSet
of its key resolves, so Gloo's bootstrap (many small Set/Get pairs) costs no
polling. Runs on the coordinator's event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from .errors import (
    InvalidRequestError,
    KeyTimeoutError,
    OutOfRangeError,
    ResourceExhaustedError,
    UnknownError,
    shown_id,
)

__all__ = ["KeyValueStore"]

# Add's integers travel as int64 (StoreAddRequest.amount, StoreAddResponse.value).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# A Wait that times out names this many of its missing keys, then counts the rest.
_KEYS_SHOWN = 8


class KeyValueStore:
    """Keys are strings, values bytes; integers for Add are decimal ASCII."""

    def __init__(
        self,
        job_id: str,
        max_key_bytes: int = 4096,
        max_value_bytes: int = 1024 * 1024,
        on_change: Callable[[str, bytes | None], None] | None = None,
        data: dict[str, bytes] | None = None,
        max_keys: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """``on_change(key, value)`` hears of every write before it is acknowledged
        (value None: deleted), e.g. the journal; ``data`` is what it restored.
        ``max_keys`` and ``max_bytes`` (UTF-8 keys and values together) are the
        job's quota; None: none."""
        self.job_id = job_id
        self._on_change = on_change
        self._max_key_bytes = max_key_bytes
        self._max_value_bytes = max_value_bytes
        self._data: dict[str, bytes] = dict(data or {})
        self._max_keys = max_keys
        self._max_bytes = max_bytes
        self._bytes = sum(_size(k, v) for k, v in self._data.items())
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return len(self._data)

    def check(self, key: str, value: bytes = b"") -> None:
        """Refuses a key or value past the store's limits (before anything changes).

        Raises:
            InvalidRequestError: the key or the value is too long.
        """
        if len(key) > self._max_key_bytes or len(key.encode()) > self._max_key_bytes:
            cut = "…" if len(key) > 64 else ""
            raise InvalidRequestError(
                f"store key {key[:64]!r}{cut} of {len(key.encode())} bytes in job "
                f"'{self.job_id}' is longer than the limit of {self._max_key_bytes} bytes"
            )
        self._check_value(key, value)

    def _check_value(self, key: str, value: bytes) -> None:
        if len(value) > self._max_value_bytes:
            raise InvalidRequestError(
                f"store value of {len(value)} bytes for key '{key[:64]}' in job "
                f"'{self.job_id}' is larger than the limit of {self._max_value_bytes} bytes"
            )

    def set(self, key: str, value: bytes) -> None:
        """Sets ``key`` and wakes everyone waiting for it.

        Raises:
            InvalidRequestError: the key or the value is past the store's limits.
        """
        self.check(key, value)
        self._put(key, value)

    @property
    def size_bytes(self) -> int:
        """Bytes held: keys (UTF-8) and values."""
        return self._bytes

    def _check_quota(self, key: str, value: bytes) -> int:
        """The store's size once ``key`` holds ``value``.

        Raises:
            ResourceExhaustedError: that passes the job's key count or byte quota.
        """
        old = self._data.get(key)
        size = self._bytes + _size(key, value) - (0 if old is None else _size(key, old))
        if (old is None and self._max_keys is not None
                and len(self._data) >= self._max_keys):
            raise ResourceExhaustedError(
                f"the store of job '{shown_id(self.job_id)}' holds {len(self._data)} keys, its "
                "quota (max_store_keys_per_job)")
        if self._max_bytes is not None and size > self._max_bytes and size > self._bytes:
            raise ResourceExhaustedError(
                f"the store of job '{shown_id(self.job_id)}' would hold {size} bytes, past its "
                f"quota of {self._max_bytes} (max_store_bytes_per_job)")
        return size

    def _put(self, key: str, value: bytes) -> None:
        """Sets a checked ``key`` and wakes everyone waiting for it.

        Raises:
            ResourceExhaustedError: past the job's store quota; nothing changes.
        """
        size = self._check_quota(key, value)
        if self._on_change is not None:
            self._on_change(key, value)
        self._data[key] = value
        self._bytes = size
        waiters = self._waiters.pop(key, None)
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def get_now(self, key: str) -> bytes:
        """The value of ``key``.

        Raises:
            UnknownError: the key is not set.
        """
        self.check(key)
        try:
            return self._data[key]
        except KeyError:
            raise UnknownError(
                f"key '{shown_id(key)}' is not set in job '{self.job_id}'"
            ) from None

    async def get(self, key: str, timeout_s: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout_s`` for it (0: answer at once).

        Raises:
            UnknownError: ``timeout_s`` is 0 and the key is not set.
            KeyTimeoutError: the key was not set in time.
        """
        if key in self._data or timeout_s <= 0:
            return self.get_now(key)
        await self.wait([key], timeout_s)
        return self._data[key]

    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        """Returns once every key is set.

        Raises:
            KeyTimeoutError: some keys were still missing after ``timeout_s``;
                the message names them.
        """
        for key in keys:
            self.check(key)
        missing = [k for k in keys if k not in self._data]
        if not missing:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        for key in missing:
            while key not in self._data:  # a Delete after the Set may unset it again
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise self._timeout(keys, timeout_s)
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.setdefault(key, set()).add(fut)
                try:
                    await asyncio.wait_for(fut, remaining)
                except asyncio.TimeoutError:
                    raise self._timeout(keys, timeout_s) from None
                finally:
                    waiters = self._waiters.get(key)
                    if waiters is not None:
                        waiters.discard(fut)
                        if not waiters:
                            del self._waiters[key]

    def _timeout(self, keys: Sequence[str], timeout_s: float) -> KeyTimeoutError:
        missing = [k for k in keys if k not in self._data]
        names = ", ".join(f"'{shown_id(k)}'" for k in missing[:_KEYS_SHOWN])
        if len(missing) > _KEYS_SHOWN:
            names += f" and {len(missing) - _KEYS_SHOWN} more"
        noun = "key" if len(missing) == 1 else "keys"
        return KeyTimeoutError(
            f"{noun} {names} of job '{self.job_id}' not set within {timeout_s * 1000:.0f} ms"
        )

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the integer at ``key`` (0 when absent); the new value.

        Checks before writing: a refused Add leaves the key as it was.

        Raises:
            InvalidRequestError: the stored value is not a decimal integer, or
                the key or the new value's digits are past the store's limits.
            OutOfRangeError: the new value would not fit in int64.
        """
        self.check(key)
        raw = self._data.get(key, b"0")
        try:
            value = int(raw.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise InvalidRequestError(
                f"key '{shown_id(key)}' holds {raw[:32]!r}, which is not a decimal integer"
            ) from None
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise OutOfRangeError(
                f"adding {amount} to key '{shown_id(key)}' of job '{self.job_id}' gives a value "
                f"outside int64; the key keeps {raw[:32]!r}"
            )
        digits = str(value).encode("ascii")
        self._check_value(key, digits)
        self._put(key, digits)
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Sets ``desired`` when the value equals ``expected`` (empty: absent); the value now."""
        self.check(key, desired)
        current = self._data.get(key)
        if (current is None and expected == b"") or (current is not None and current == expected):
            self._put(key, desired)
            return desired
        return current if current is not None else b""

    def delete(self, key: str) -> bool:
        """Deletes ``key``; whether it existed."""
        self.check(key)
        if key not in self._data:
            return False
        if self._on_change is not None:
            self._on_change(key, None)
        self._bytes -= _size(key, self._data.pop(key))
        return True


def _size(key: str, value: bytes) -> int:
    return len(key.encode()) + len(value)
