"""Where ranks sit among hosts: local and cross ranks, as Horovod numbers them.

The launcher places ranks before starting workers and the coordinator
places the members of every generation; both use :func:`place`, so a worker
sees the same numbers whichever of them decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Placement", "place"]


@dataclass(frozen=True)
class Placement:
    """Where one rank sits among the hosts."""

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def place(hosts: Sequence[str]) -> tuple[list[Placement], bool]:
    """Local and cross ranks for ranks whose hosts are ``hosts[rank]``.

    local_rank is the index among the same host's ranks; cross_rank the index
    of the host among the hosts that have that local_rank, hosts ordered by
    their lowest rank; cross_size the number of those hosts.

    Returns:
        One placement per rank, and whether every host has the same number of ranks.
    """
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)  # insertion order = lowest rank first
    # hosts_with[lr] = hosts having a rank with local_rank lr, in host order.
    hosts_with: list[list[str]] = []
    for host, ranks in by_host.items():
        for local_rank in range(len(ranks)):
            if local_rank == len(hosts_with):
                hosts_with.append([])
            hosts_with[local_rank].append(host)
    cross_index = [{host: i for i, host in enumerate(hs)} for hs in hosts_with]
    placements = []
    local_index = dict.fromkeys(by_host, 0)
    for host in hosts:
        local_rank = local_index[host]
        local_index[host] += 1
        placements.append(Placement(local_rank, len(by_host[host]),
                                    cross_index[local_rank][host], len(hosts_with[local_rank])))
    homogeneous = len({len(ranks) for ranks in by_host.values()}) <= 1
    return placements, homogeneous
