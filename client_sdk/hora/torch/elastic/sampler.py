"""ElasticSampler: a distributed sampler that resumes mid-epoch in a resized world."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.utils.data

from ..mpi_ops import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset among the current ranks, skipping what was already processed.

    Record what each step consumed with :meth:`record_batch` (or
    :meth:`record_indices`) before ``state.commit()``; after a reset the
    remaining samples of the epoch are spread over the new world, so no
    committed sample is seen twice and none is skipped.

    Every rank knows the whole partition (it is computed the same way
    everywhere), so :meth:`record_batch` records the batch of every rank,
    not only its own: when a worker dies between its step and its commit,
    the survivors' record still has its samples.

    Args:
        dataset: the dataset to sample from.
        shuffle: shuffle each epoch (the same permutation on every rank).
        seed: the shuffle seed; the epoch is added to it.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self._shares: list[list[int]] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Marks the samples of batch ``batch_idx`` of every rank as processed."""
        start = batch_idx * batch_size
        for share in self._shares:
            self.record_indices(share[start:start + batch_size])

    def record_indices(self, indices: Any) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of local batch ``batch_idx`` in the current iteration."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Recomputes every rank's share of what remains, for the current world.

        Done once per reset, not per batch: record_batch only slices the shares.
        """
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = [order[i] for i in torch.randperm(len(order), generator=gen).tolist()]
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        padded = list(self.remaining_indices)
        # Pad so every rank gets the same number of samples (same number of steps).
        while padded and len(padded) < self.total_size:
            padded += padded[:self.total_size - len(padded)]
        self._shares = [padded[r:self.total_size:self.num_replicas]
                        for r in range(self.num_replicas)]
        self.indices = self._shares[self.rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
