"""Shared-memory segments of the mesh (files in /dev/shm) and its reused buffers."""

from __future__ import annotations

import mmap
import os

import torch

from .base import BackendError, RegionViews

__all__ = ["Segment", "at_least", "peer_view", "unlink"]

# The most regions of one segment kept as tensors (:meth:`Segment.region`).
_KEPT_REGIONS = 8


def at_least(buf: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """``buf`` if it holds ``nbytes``, else a uint8 buffer grown geometrically."""
    if buf is not None and buf.numel() >= nbytes:
        return buf
    return torch.empty(max(nbytes, 2 * buf.numel() if buf is not None else 0),
                       dtype=torch.uint8)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Segment:
    """A file in /dev/shm, mapped into this process; ``half`` is half its size."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    # Reserve the pages now: a full tmpfs then fails here with
                    # ENOSPC instead of killing the process with SIGBUS later.
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    os.unlink(path)
                    raise
            else:
                size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.half = size // 2
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self._regions = RegionViews(_KEPT_REGIONS)

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` at ``offset`` (uint8): the same tensor each time it is
        asked for (slicing costs several µs, and the exchanges of a training loop
        use the same few regions)."""
        return self._regions.get(self.tensor, offset, nbytes, torch.uint8)

    def close(self) -> None:
        self._regions.clear()
        del self.tensor
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it


def peer_view(opened: dict[int, tuple[int, Segment]], rank: int, peer: int, version: int,
              path: str, what: str, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` at ``offset`` of ``peer``'s segment ``path`` (version ``version``),
    opened once per version and kept in ``opened``; ``rank`` is this rank.

    Raises:
        BackendError: the file cannot be opened (``what`` names it in the message).
    """
    found = opened.get(peer)
    if found is None or found[0] != version:
        try:
            segment = Segment(path, 0, create=False)
        except OSError as exc:
            raise BackendError(f"control mesh: rank {rank} could not open rank "
                               f"{peer}'s {what} {path}: {exc}") from exc
        if found is not None:
            found[1].close()
        opened[peer] = found = (version, segment)
    return found[1].region(offset, nbytes)
