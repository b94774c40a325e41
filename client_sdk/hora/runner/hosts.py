"""Hosts, slots and rank placement for ``horarun``.

Everything here is pure except :func:`is_local_host`, which looks at this
machine's names and addresses. Placement follows horovodrun: ranks fill the
hosts in the order given, all of the first host's slots before the second's,
and local and cross ranks are computed the way the coordinator computes them
so that what the launcher tells a worker agrees with what ``hvd.init()``
later answers.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hora_proto.placement import place

__all__ = [
    "HostError",
    "HostSlots",
    "SlotInfo",
    "assign_ranks",
    "data_plane_address",
    "is_local_host",
    "is_loopback_host",
    "parse_discovery_output",
    "parse_hostfile",
    "parse_hosts",
]


class HostError(ValueError):
    """A host list, a hostfile or a placement request cannot be used.

    Raised for malformed ``-H`` values or hostfile lines, non-positive slot
    counts, and more processes than the hosts have slots. The message is
    meant for the user as is.
    """


@dataclass(frozen=True)
class HostSlots:
    """A host as given by the user and how many workers it may run."""

    hostname: str
    slots: int


@dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place in the world.

    Attributes:
        hostname: the host name as the user gave it.
        rank: global rank, 0 .. size-1.
        size: world size.
        local_rank: index of this rank among the ranks on its host.
        local_size: number of ranks on its host.
        cross_rank: index of its host among the hosts that run a rank with
            the same local_rank.
        cross_size: number of hosts that run a rank with this local_rank.
    """

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def _parse_slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise HostError(f"{where}: slots must be an integer, got {text!r}") from None
    if slots < 1:
        raise HostError(f"{where}: slots must be at least 1, got {slots}")
    return slots


def _split_host_slots(item: str, where: str, default_slots: int = 1) -> HostSlots:
    """Parses ``host``, ``host:N`` or ``[v6addr]:N``; a bare host has ``default_slots``."""
    item = item.strip()
    if not item:
        raise HostError(f"{where}: empty host name")
    if item.startswith("["):
        # Bracketed IPv6 literal, the only form in which a colon may appear
        # inside the host part.
        end = item.find("]")
        if end < 0:
            raise HostError(f"{where}: unbalanced '[' in {item!r}")
        host, rest = item[1:end], item[end + 1 :]
        if rest and not rest.startswith(":"):
            raise HostError(f"{where}: expected HOST:SLOTS, got {item!r}")
        slots_text = rest[1:] if rest else str(default_slots)
    elif ":" in item:
        host, _, slots_text = item.rpartition(":")
    else:
        host, slots_text = item, str(default_slots)
    if not host:
        raise HostError(f"{where}: empty host name in {item!r}")
    return HostSlots(host, _parse_slots(slots_text, where))


def _merge(hosts: Iterable[HostSlots]) -> list[HostSlots]:
    """Sums the slots of a host named twice, keeping its first position."""
    slots: dict[str, int] = {}
    for host in hosts:
        slots[host.hostname] = slots.get(host.hostname, 0) + host.slots
    return [HostSlots(name, n) for name, n in slots.items()]


def parse_hosts(text: str) -> list[HostSlots]:
    """Parses a ``-H`` value such as ``"h1:2,h2:2"``.

    Args:
        text: comma-separated ``host[:slots]`` items; a host without slots
            has one, as in horovodrun.

    Returns:
        The hosts in the order given, a repeated host merged into its first
        occurrence.

    Raises:
        HostError: an item is empty or its slot count is not a positive integer.
    """
    items = text.split(",")
    if not any(item.strip() for item in items):
        raise HostError("-H: no hosts given")
    return _merge(_split_host_slots(item, "-H") for item in items)


def parse_hostfile(lines: Iterable[str], name: str = "hostfile") -> list[HostSlots]:
    """Parses hostfile lines: ``host slots=N``, ``host:N`` or ``host``.

    Blank lines and ``#`` comments are skipped.

    Args:
        lines: the file's lines.
        name: the file name, used in error messages.

    Raises:
        HostError: a line cannot be parsed, naming the file and line number.
    """
    hosts: list[HostSlots] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{number}"
        fields = line.split()
        if len(fields) == 1:
            hosts.append(_split_host_slots(fields[0], where))
        elif len(fields) == 2 and fields[1].startswith("slots="):
            hosts.append(HostSlots(fields[0], _parse_slots(fields[1][len("slots="):], where)))
        else:
            raise HostError(f"{where}: expected 'HOST slots=N' or 'HOST:N', got {line!r}")
    if not hosts:
        raise HostError(f"{name}: no hosts in hostfile")
    return _merge(hosts)


def parse_discovery_output(text: str, default_slots: int = 1,
                           name: str = "host discovery") -> list[HostSlots]:
    """Parses what a host discovery script printed: ``host`` or ``host:slots`` lines.

    Blank lines and ``#`` comments are skipped; no hosts at all is a valid
    answer (every host is gone).

    Args:
        text: the script's standard output.
        default_slots: slots of a host printed without ``:slots``
            (``--slots-per-host``).
        name: what error messages call the output.

    Returns:
        The hosts in the order printed, a repeated host merged into its first
        occurrence.

    Raises:
        HostError: a line is not ``host[:slots]`` with a positive slot count.
    """
    hosts: list[HostSlots] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name} line {number}"
        if len(line.split()) != 1:
            raise HostError(f"{where}: expected HOST or HOST:SLOTS, got {line!r}")
        hosts.append(_split_host_slots(line, where, default_slots))
    return _merge(hosts)


def assign_ranks(hosts: Sequence[HostSlots], num_proc: int) -> list[SlotInfo]:
    """Places ``num_proc`` ranks on ``hosts``, host by host in order.

    Args:
        hosts: hosts with their slots, in placement order.
        num_proc: world size, at least 1.

    Returns:
        One :class:`SlotInfo` per rank, indexed by rank. Hosts left without
        a rank do not count towards any cross size.

    Raises:
        HostError: ``num_proc`` is below 1 or exceeds the total slots.
    """
    if num_proc < 1:
        raise HostError(f"-np must be at least 1, got {num_proc}")
    total = sum(host.slots for host in hosts)
    if num_proc > total:
        listing = ",".join(f"{h.hostname}:{h.slots}" for h in hosts)
        raise HostError(
            f"-np {num_proc} needs {num_proc} slots but the hosts have only {total} "
            f"({listing}); add slots with -H host:N or lower -np"
        )

    placed: list[str] = []
    for host in hosts:
        placed.extend([host.hostname] * min(host.slots, num_proc - len(placed)))
    placements, _ = place(placed)
    return [
        SlotInfo(hostname=hostname, rank=rank, size=num_proc, local_rank=p.local_rank,
                 local_size=p.local_size, cross_rank=p.cross_rank, cross_size=p.cross_size)
        for rank, (hostname, p) in enumerate(zip(placed, placements, strict=True))
    ]


def _loopback(hostname: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(hostname)
    except ValueError:
        return None
    return address if address.is_loopback else None


@functools.lru_cache(maxsize=1)
def _local_names() -> frozenset[str]:
    """This machine's names and addresses, as far as they can be learnt locally.

    Only the names of this machine are resolved, never the user's hosts:
    resolving arbitrary names could block on DNS before any worker starts.
    """
    names = {"localhost", "localhost.localdomain", "0.0.0.0", "::"}
    hostname = socket.gethostname()
    names.add(hostname)
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    try:
        _, aliases, addresses = socket.gethostbyname_ex(hostname)
    except OSError:
        aliases, addresses = [], []
    names.update(aliases)
    names.update(addresses)
    return frozenset(n.lower() for n in names)


def is_loopback_host(hostname: str) -> bool:
    """Whether ``hostname`` is ``localhost`` or a loopback address (no DNS lookup)."""
    return hostname.lower() in ("localhost", "localhost.localdomain") or \
        _loopback(hostname) is not None


def is_local_host(hostname: str) -> bool:
    """Whether ``hostname`` names this machine.

    ``localhost``, any loopback address (``127.x.x.x``, ``::1``) and this
    machine's host name, FQDN and addresses are local.
    """
    if _loopback(hostname) is not None:
        return True
    return hostname.lower() in _local_names()


def data_plane_address(hostname: str) -> str:
    """The address a local worker on ``hostname`` binds its data plane to.

    A loopback alias such as ``127.0.0.2`` keeps its own address, so that
    ``-H 127.0.0.2:1,127.0.0.3:1`` behaves like two hosts on one machine;
    every other local name binds to ``127.0.0.1``.
    """
    address = _loopback(hostname)
    # Only IPv4 aliases: Gloo's default transport here is set up for IPv4.
    if isinstance(address, ipaddress.IPv4Address):
        return str(address)
    return "127.0.0.1"
