"""Which address of this machine the other machines of a job can reach.

On one machine every process listens on loopback. Once a job spans machines,
each process must listen on an address its peers can route to: the one of a
named network interface (the launcher's ``--network-interface``), or else
the address this machine would use to reach the coordinator, which the
kernel's routing table answers without sending a packet.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import threading
from typing import Any

__all__ = ["interface_address", "interface_names", "route_source"]

_SIOCGIFADDR = 0x8915  # Linux: the interface's IPv4 address
_RESOLVE_TIMEOUT_S = 10.0


def interface_names() -> list[str]:
    """This machine's network interfaces, e.g. ``['lo', 'eth0']``."""
    return [name for _index, name in socket.if_nameindex()]


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``.

    Raises:
        ValueError: no such interface, or it has no IPv4 address; the message
            lists the interfaces this machine has.
    """
    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError as exc:
            raise ValueError(
                f"network interface {name!r} has no IPv4 address ({exc.strerror}); "
                f"this machine has {', '.join(interface_names())}") from None
    return socket.inet_ntoa(reply[20:24])


def route_source(host: str, timeout: float = _RESOLVE_TIMEOUT_S) -> str:
    """The IPv4 address this machine sends from to reach ``host``.

    Connecting a UDP socket only consults the routing table; nothing is sent.

    Raises:
        OSError: ``host`` does not resolve within ``timeout`` seconds, or no
            route leads to it.
    """
    # getaddrinfo has no deadline of its own: a hung DNS server must not hang
    # the caller, nor (hence a daemon thread) hold up the process's exit.
    answer: list[Any] = []

    def resolve() -> None:
        try:
            answer.append(socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM))
        except OSError as exc:
            answer.append(exc)

    thread = threading.Thread(target=resolve, name="hora-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if not answer:
        raise OSError(f"resolving {host!r} took more than {timeout:g} s")
    if isinstance(answer[0], OSError):
        raise answer[0]
    infos = answer[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(infos[0][4])
        return str(sock.getsockname()[0])
