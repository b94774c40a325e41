"""A torch.distributed.Store backed by the coordinator's key-value store.

Gloo and NCCL bootstrap through it: each rank publishes its address and
reads the others'. Gloo calls only set, get and wait (plus add for its init
barrier), a handful of times per rank at init and never during collectives,
so one gRPC round trip per call costs nothing that matters.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ._client import CoordinatorClient

__all__ = ["CoordinatorStore"]


def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class CoordinatorStore(dist.Store):
    """Store operations forwarded to the coordinator, each with a deadline.

    Args:
        client: the worker's coordinator client.
        timeout: how long get and wait wait for a key that is not set yet.
    """

    def __init__(self, client: CoordinatorClient, timeout: timedelta) -> None:
        super().__init__()
        self._client = client
        self._timeout = timeout
        self.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._client.store_set(key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._client.store_get(key, self._timeout)

    def add(self, key: str, amount: int) -> int:
        return self._client.store_add(key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._client.store_compare_set(key, _as_bytes(expected), _as_bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._client.store_wait(list(keys), timeout or self._timeout)

    def check(self, keys: list[str]) -> bool:
        try:
            self._client.store_wait(list(keys), timedelta(0))
        except KeyError:
            return False
        return True

    def delete_key(self, key: str) -> bool:
        return self._client.store_delete(key)
