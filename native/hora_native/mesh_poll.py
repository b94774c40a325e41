"""Waiting on the mesh's sockets with poll(): any descriptor number works.

``select()`` takes descriptors below 1024 only; a worker that holds more
files (a big data loader, or strangers' connections during set-up) would
fail its exchanges. poll() has no such limit and, for the few sockets of a
mesh, costs about the same.

Before it sleeps in poll(), an exchange whose caller waits in its own thread
polls its sockets without sleeping for up to ``SPIN_S``. Waking a process
that sleeps is the kernel's dearest step on a virtual machine: on the
Intel host of bench/README.md ("Twelfth pass") a 64-byte round trip over a
Unix socket took 85 µs between two sleeping processes and 5 µs between two
spinning ones. Only where each rank on the machine has a core of its own
and the CPU time for it (:func:`cores_for`): a rank that spins on a shared
core delays the very peer it waits for, and one that spins under a CPU
quota spends the time its peers on the same quota need.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Sequence

__all__ = ["SPIN_S", "cores_for", "cpu_quota", "ready_sockets"]

#: How long a waiting caller's exchange polls without sleeping, in seconds.
SPIN_S = 200e-6


def cores_for(ranks: int) -> bool:
    """Whether this process may run on at least ``ranks`` cores: its affinity
    (where the platform has one), and the CPU time its control groups allow
    (:func:`cpu_quota`: a container's CPU limit, a Kubernetes pod's
    ``resources.limits.cpu``), which on a large host is often far below the
    cores it may be scheduled on. Spinning ranks would spend that quota and
    be throttled."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores: float = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, quota)
    return ranks <= cores


def cpu_quota(proc: str = "/proc/self") -> float | None:
    """The fewest CPUs' worth of time the control groups of the process at
    ``proc`` allow it: the tightest CFS quota over its cgroup and the groups
    above it (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``). None without a quota, or where the groups cannot
    be read (not Linux, no cgroup file system mounted)."""
    try:
        # (Any mount's name may be in any encoding: read as bytes kept as they are.)
        with open(os.path.join(proc, "cgroup"), encoding="utf-8",
                  errors="surrogateescape") as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open(os.path.join(proc, "mountinfo"), encoding="utf-8",
                  errors="surrogateescape") as f:
            mounts = [line.split() for line in f]
    except (OSError, ValueError):
        return None
    tightest: float | None = None
    for fields in mounts:
        if "-" not in fields:
            continue
        dash = fields.index("-")  # then the file system type, source and options
        if dash < 5 or len(fields) <= dash + 3:
            continue
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup2":
            paths = [path for hid, controllers, path in memberships if hid == "0" and not controllers]
        elif fstype == "cgroup" and "cpu" in options:
            paths = [path for _hid, controllers, path in memberships
                     if "cpu" in controllers.split(",")]
        else:
            continue
        for path in paths:
            quota = _quota_along(mount_point, root, path, v2=fstype == "cgroup2")
            if quota is not None and (tightest is None or quota < tightest):
                tightest = quota
    return tightest


def _unescape(field: str) -> str:
    """A mountinfo path as it is: the kernel writes space, tab, newline and
    backslash as octal escapes (``\\040``)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _quota_along(mount_point: str, root: str, path: str, v2: bool) -> float | None:
    """The tightest quota from the group at ``path`` up to the mount's root
    (None for a group outside the mount: another cgroup namespace's)."""
    if root != "/":
        if path != root and not path.startswith(root.rstrip("/") + "/"):
            return None
        path = path[len(root):]
    mount_point = os.path.normpath(mount_point)
    here = os.path.normpath(os.path.join(mount_point, path.lstrip("/")))
    if os.path.commonpath([here, mount_point]) != mount_point:
        return None  # ("/../x": a group above this namespace's root)
    tightest: float | None = None
    while True:
        quota = _group_quota(here, v2)
        if quota is not None and (tightest is None or quota < tightest):
            tightest = quota
        if here == mount_point:
            return tightest
        here = os.path.dirname(here)


def _group_quota(folder: str, v2: bool) -> float | None:
    """One group's CFS quota in CPUs (None: none, or not readable)."""
    try:
        if v2:
            with open(os.path.join(folder, "cpu.max"), encoding="utf-8") as f:
                limit, period = (f.read().split() + ["100000"])[:2]
            if limit == "max":
                return None
        else:
            with open(os.path.join(folder, "cpu.cfs_quota_us"), encoding="utf-8") as f:
                limit = f.read().strip()
            with open(os.path.join(folder, "cpu.cfs_period_us"), encoding="utf-8") as f:
                period = f.read().strip()
        quota, every = int(limit), int(period)
    except (OSError, ValueError):
        return None
    return quota / every if quota > 0 and every > 0 else None

_BROKEN = select.POLLERR | select.POLLHUP | select.POLLNVAL


def ready_sockets(wake: socket.socket, reading: Sequence[socket.socket],
                  writing: Sequence[socket.socket], timeout: float, spin_until: float = 0.0
                  ) -> tuple[list[socket.socket], list[socket.socket]]:
    """The sockets of ``reading`` ready to read and of ``writing`` ready to write.

    Waits at most ``timeout`` seconds, or until ``wake`` is readable (it is
    never returned: the caller checks why it was woken). Errors and hang-ups
    count as ready both ways, as with select(): the read or the write then
    raises the socket's error. Until ``spin_until`` (a ``time.perf_counter()``
    time) it asks without sleeping, and sleeps only after it.
    """
    poller = select.poll()
    wanted: dict[int, int] = {wake.fileno(): select.POLLIN}
    by_fd: dict[int, socket.socket] = {}
    for conn in reading:
        by_fd[conn.fileno()] = conn
        wanted[conn.fileno()] = select.POLLIN
    for conn in writing:
        by_fd[conn.fileno()] = conn
        wanted[conn.fileno()] = wanted.get(conn.fileno(), 0) | select.POLLOUT
    for fd, mask in wanted.items():
        poller.register(fd, mask)
    ready_in: list[socket.socket] = []
    ready_out: list[socket.socket] = []
    events: list[tuple[int, int]] = []
    while not events and time.perf_counter() < spin_until:
        events = poller.poll(0)
    if not events:
        events = poller.poll(max(0.0, timeout) * 1000.0)
    for fd, got in events:
        if fd not in by_fd:
            continue  # the wake-up socket
        if got & (select.POLLIN | _BROKEN) and wanted[fd] & select.POLLIN:
            ready_in.append(by_fd[fd])
        if got & (select.POLLOUT | _BROKEN) and wanted[fd] & select.POLLOUT:
            ready_out.append(by_fd[fd])
    return ready_in, ready_out
