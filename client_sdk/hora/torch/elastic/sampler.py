"""ElasticSampler: a distributed sampler that resumes mid-epoch in a resized world."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch.utils.data

from ..mpi_ops import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset among the current ranks, skipping what was already processed.

    Horovod 0.28.1's sampler, partition for partition: each epoch orders the
    dataset with ``random.Random(seed + epoch).shuffle``; the first
    ``processed_num`` samples of that order are done, and rank ``r`` of ``n``
    takes every ``n``-th remaining sample from ``r`` (padded by wrapping
    around so that every rank has ``ceil(remaining / n)``).

    In the training loop call :meth:`record_batch` after each batch, before
    ``state.commit()``: it counts the batch of every rank (``batch_size *
    num_replicas`` samples), which are exactly the next samples of the order.
    After a reset the samples left are spread over the new world, so no
    committed sample is seen twice and none is skipped. Call :meth:`set_epoch`
    at the end of an epoch.

    The older interface (``record_indices``, ``get_indices`` and the set
    ``processed_indices``) still works: recorded indices are skipped too.

    Args:
        dataset: the dataset to sample from (its length must not change).
        shuffle: shuffle each epoch (the same permutation on every rank).
        seed: the shuffle seed, the same on every rank; the epoch is added to it.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` with nothing processed (call it when an epoch ends)."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Counts one batch of ``batch_size`` samples on every rank as processed."""
        del batch_idx  # Horovod's signature; batches are counted in order
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[Any]) -> None:
        """Marks dataset indices as processed (the interface before ``record_batch``)."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of this rank's batch ``batch_idx`` in the current iteration."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self) -> dict[str, Any]:
        """Horovod's keys, ``epoch`` and ``processed_num`` (and recorded indices, if any)."""
        state: dict[str, Any] = {"epoch": self.epoch, "processed_num": self.processed_num}
        if self.processed_indices:
            state["processed_indices"] = set(self.processed_indices)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict` (also one saved with only ``processed_indices``)."""
        self.epoch = state_dict["epoch"]
        self.processed_num = int(state_dict.get("processed_num", 0))
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def reset(self) -> None:
        """Partitions what is left of the epoch among the current world's ranks."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        remaining = order[self.processed_num:]
        if self.processed_indices:
            remaining = [i for i in remaining if i not in self.processed_indices]
        self.remaining_indices = remaining
        self.num_samples = int(math.ceil(len(remaining) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        padded = list(remaining)
        # Wrap around so that every rank has the same number of samples (Horovod
        # wraps once; more only when fewer samples than ranks are left).
        while padded and len(padded) < self.total_size:
            padded += padded[:self.total_size - len(padded)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
