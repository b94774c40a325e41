"""A network namespace of the test's own, with one non-loopback address.

Processes started with :attr:`NetworkNamespace.prefix` run inside it, where
``address`` (on a veth pair made for the test) is a real, routable-looking
address that no other machine and no other test can reach: a coordinator
bound to it is "off loopback" for real, and the test only ever talks to the
address it made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

__all__ = ["NetworkNamespace", "NetnsUnavailable"]


class NetnsUnavailable(RuntimeError):
    """This machine cannot make a network namespace (not root, no ``ip``, ...)."""


class NetworkNamespace:
    """``ip netns add`` a namespace with ``lo`` up and ``address`` on a veth pair.

    Attributes:
        name: The namespace's name.
        address: The IPv4 address inside it (not loopback).
        prefix: Command prefix that runs a program inside it.
    """

    def __init__(self, address: str = "10.213.0.1") -> None:
        self.name = f"hora-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.address = address
        self.prefix = ["ip", "netns", "exec", self.name]
        self._created = False

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def create(self) -> NetworkNamespace:
        """Makes the namespace and its interfaces.

        Raises:
            NetnsUnavailable: not root, no ``ip`` tool, or the kernel refused.
        """
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no 'ip' tool (iproute2)")
        self._ip("netns", "add", self.name)
        self._created = True
        inside = ("-n", self.name)
        self._ip(*inside, "link", "set", "lo", "up")
        self._ip(*inside, "link", "add", "hora0", "type", "veth", "peer", "name", "hora1")
        self._ip(*inside, "addr", "add", f"{self.address}/24", "dev", "hora0")
        self._ip(*inside, "link", "set", "hora0", "up")
        self._ip(*inside, "link", "set", "hora1", "up")
        return self

    def delete(self) -> None:
        """Removes the namespace (idempotent); its interfaces go with it."""
        if self._created:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
            self._created = False
