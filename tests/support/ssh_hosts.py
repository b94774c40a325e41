"""Machines of a test's own: network namespaces on a bridge, each running a real sshd.

:class:`SshHosts` builds, with ``ip netns`` and the machine's own OpenSSH::

    switch namespace: br0 (a bridge, no address)
      |-- client (10.77.0.10): where horovodrun runs, the "launching machine"
      |-- h1 (10.77.0.11), h2 (.12), h3 (.13): each runs /usr/sbin/sshd

Every namespace's link is ``eth0``, so ``--network-interface eth0`` names the
same interface on every "machine", as on a real cluster. What makes them
separate machines for hora:

- **Network.** Bytes between two hosts cross two veth pairs and the bridge:
  real TCP between different network stacks, never loopback. ``link(host,
  up=False)`` cuts a host off without closing a socket, as a pulled cable.
- **Shared memory.** sshd (and so every session and worker it starts) runs
  in a mount namespace of its own with a private tmpfs on ``/dev/shm``, so
  ranks on different hosts cannot open each other's segments, exactly as on
  two machines: hora's mesh finds that out and sends payloads over TCP.
- **Names.** ``h1``, ``h2``, ``h3`` resolve in every namespace through
  ``/etc/netns/NAME/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``
  for that command only; the machine's own ``/etc/hosts`` is never touched.

Shared, as on a cluster with a shared file system: every path (the venv,
the source tree, the test's temporary directory) and the user (root).

ssh: a fresh ed25519 client key, authorised on every host; per-host ed25519
host keys written into a known_hosts file of our own (so ``~/.ssh`` of the
user running the tests is neither read nor written; ``ssh -F`` names our
config). sshd listens on port 2222, not 22, so a launcher that does not pass
``--ssh-port`` fails: the tests prove that horovodrun's flags reach ssh.

Everything made here is removed by :meth:`SshHosts.close`, which kills every
process left in the namespaces (only ever ones this object started: sshd,
its sessions and what they ran), deletes the namespaces and the
``/etc/netns`` entries, and is safe to call after a partial start.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Host", "SshHosts", "SshHostsUnavailable", "SshdError", "missing_tools",
           "running_hosts"]

SSHD = "/usr/sbin/sshd"
SSH_PORT = 2222
SUBNET = "10.77.0"
CLIENT_ADDRESS = f"{SUBNET}.10"
_IP_TIMEOUT = 10.0
_SSHD_START_TIMEOUT = 15.0


class SshHostsUnavailable(RuntimeError):
    """This machine cannot host the namespaces (not root, a tool missing, the kernel refused)."""


class SshdError(RuntimeError):
    """The namespaces were made, but an sshd did not start or ssh could not log in to it."""


def missing_tools() -> list[str]:
    """What this machine lacks for :class:`SshHosts`, as the Debian package or the reason.

    Empty when everything is there. Does not try to make a namespace; :meth:`SshHosts.start`
    raises :class:`SshHostsUnavailable` when the kernel refuses one.
    """
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces and sshd need it)")
    if shutil.which("ip") is None:
        missing.append("iproute2 (the 'ip' tool)")
    if not os.access(SSHD, os.X_OK):
        missing.append(f"openssh-server ({SSHD})")
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            missing.append(f"openssh-client ({tool})")
    return missing


@dataclass
class Host:
    """One "machine": a namespace, its address, and its sshd.

    Attributes:
        name: the host name that resolves to ``address`` (``h1``).
        namespace: the network namespace's name.
        address: its IPv4 address on ``eth0``.
    """

    name: str
    namespace: str
    address: str
    sshd: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def prefix(self) -> list[str]:
        """Runs a command inside this host's network namespace."""
        return ["ip", "netns", "exec", self.namespace]


def _run(argv: Sequence[str], timeout: float = _IP_TIMEOUT) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SshHostsUnavailable(f"{' '.join(argv)}: no answer within {timeout:g} s") from exc
    except OSError as exc:
        raise SshHostsUnavailable(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise SshHostsUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


class SshHosts:
    """``count`` hosts with sshd on a bridge, and a client namespace to launch from.

    Args:
        workdir: a directory of the caller's (keys, configs, sshd logs).
        count: number of hosts (``h1`` .. ``hN``), at most 9.
        shm_size: size of each host's private ``/dev/shm``.

    Use as a context manager, or call :meth:`start` and, always, :meth:`close`.
    """

    def __init__(self, workdir: Path, count: int = 3, shm_size: str = "2g") -> None:
        if not 1 <= count <= 9:
            raise ValueError(f"count must be in 1..9, got {count}")
        self.workdir = workdir
        tag = f"{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
        self._switch = f"hsw{tag}"
        self.client = Host("client", f"hcl{tag}", CLIENT_ADDRESS)
        self.hosts = [Host(f"h{i}", f"hh{tag}{i}", f"{SUBNET}.{10 + i}")
                      for i in range(1, count + 1)]
        self._shm_size = shm_size
        self._namespaces: list[str] = []
        self._etc_dirs: list[Path] = []
        self._logs: dict[str, Path] = {}
        self.key = workdir / "id_ed25519"
        self.ssh_config = workdir / "ssh_config"
        self.port = SSH_PORT

    # -- set-up ---------------------------------------------------------------------

    def __enter__(self) -> SshHosts:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> SshHosts:
        """Makes the namespaces, the keys and configs, starts every sshd, and checks
        that ssh with key authentication reaches each host.

        Raises:
            SshHostsUnavailable: a tool is missing, or the kernel refused a namespace.
            SshdError: an sshd did not come up, or ssh could not log in to it (its
                log is quoted).
            Whatever was made is removed in either case.
        """
        missing = missing_tools()
        if missing:
            raise SshHostsUnavailable("missing: " + ", ".join(missing))
        try:
            self._network()
            self._keys()
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation
            for host in self.hosts:
                self.start_sshd(host)
            self._check_ssh()
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _network(self) -> None:
        self._add_namespace(self._switch)
        sw = ("ip", "-n", self._switch)
        _run([*sw, "link", "add", "br0", "type", "bridge"])
        _run([*sw, "link", "set", "br0", "up"])
        hosts_file = Path("/etc/hosts").read_text(encoding="utf-8", errors="replace")
        hosts_file += "".join(f"{h.address} {h.name}\n" for h in [self.client, *self.hosts])
        for host in [self.client, *self.hosts]:
            self._add_namespace(host.namespace)
            port = f"p{host.name}"
            _run([*sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                  "netns", host.namespace])
            _run([*sw, "link", "set", port, "master", "br0"])
            _run([*sw, "link", "set", port, "up"])
            _run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24",
                  "dev", "eth0"])
            _run(["ip", "-n", host.namespace, "link", "set", "eth0", "up"])
            etc = Path("/etc/netns") / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            self._etc_dirs.append(etc)
            (etc / "hosts").write_text(hosts_file, encoding="utf-8")

    def _keys(self) -> None:
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hora-test-client",
              "-f", str(self.key)])
        authorized = self.workdir / "authorized_keys"
        shutil.copyfile(f"{self.key}.pub", authorized)
        known = []
        for host in self.hosts:
            key = self.workdir / f"{host.name}_host_ed25519_key"
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name,
                  "-f", str(key)])
            public = Path(f"{key}.pub").read_text(encoding="ascii").split()
            known.append(f"[{host.name}]:{self.port},[{host.address}]:{self.port} "
                         f"{public[0]} {public[1]}\n")
            (self.workdir / f"{host.name}_sshd_config").write_text(
                f"Port {self.port}\n"
                f"ListenAddress {host.address}\n"
                f"HostKey {key}\n"
                f"PidFile {self.workdir / f'{host.name}_sshd.pid'}\n"
                f"AuthorizedKeysFile {authorized}\n"
                "PermitRootLogin prohibit-password\n"
                "PubkeyAuthentication yes\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                # The temporary directory is not root-owned all the way up.
                "StrictModes no\n"
                "PrintMotd no\n"
                # A client whose link is cut is let go within 6 s: the session
                # closes, and hora's guard stops what it ran.
                "ClientAliveInterval 2\n"
                "ClientAliveCountMax 3\n"
                "MaxStartups 100:30:200\n"
                "MaxSessions 100\n"
                "LogLevel INFO\n", encoding="ascii")
        (self.workdir / "known_hosts").write_text("".join(known), encoding="ascii")
        self.ssh_config.write_text(
            "Host *\n"
            f"    UserKnownHostsFile {self.workdir / 'known_hosts'}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    IdentitiesOnly yes\n"
            "    LogLevel ERROR\n", encoding="ascii")

    def start_sshd(self, host: Host) -> None:
        """Starts (or restarts) ``host``'s sshd and waits until it listens.

        Raises:
            SshdError: it exited or wrote no pid file within 15 s.
        """
        self.stop_sshd(host)
        pid_file = self.workdir / f"{host.name}_sshd.pid"
        pid_file.unlink(missing_ok=True)
        log = self.workdir / f"{host.name}_sshd.log"
        self._logs[host.name] = log
        # A private /dev/shm for the host, made inside the mount namespace that
        # `ip netns exec` gives this command and everything sshd starts.
        script = (f"mount -t tmpfs -o size={self._shm_size},mode=1777 hora-{host.name}-shm "
                  f"/dev/shm && exec {SSHD} -D -e -f {self.workdir / f'{host.name}_sshd_config'}")
        with open(log, "ab") as out:
            host.sshd = subprocess.Popen([*host.prefix, "/bin/sh", "-c", script],
                                         stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _SSHD_START_TIMEOUT
        # sshd writes its pid file once its listening socket is bound.
        while not pid_file.exists():
            if host.sshd.poll() is not None or time.monotonic() > deadline:
                raise SshdError(f"sshd on {host.name} did not start:\n"
                                          f"{self.sshd_log(host)}")
            time.sleep(0.02)

    def stop_sshd(self, host: Host) -> None:
        """Stops ``host``'s sshd listener (sessions it started keep running, as with
        ``systemctl stop ssh``)."""
        if host.sshd is None:
            return
        if host.sshd.poll() is None:
            host.sshd.terminate()
            try:
                host.sshd.wait(5)
            except subprocess.TimeoutExpired:
                host.sshd.kill()
                host.sshd.wait(5)
        host.sshd = None

    def _check_ssh(self) -> None:
        procs = [(host, subprocess.Popen(
            [*self.client.prefix, *self.ssh_command(), "-p", str(self.port), "-i",
             str(self.key), "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host.name,
             "true"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)) for host in self.hosts]
        problems = []
        for host, proc in procs:
            try:
                _, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode != 0:
                problems.append(f"ssh {host.name} true: exit {proc.returncode}: "
                                f"{err.decode(errors='replace').strip()}\n"
                                f"sshd log:\n{self.sshd_log(host)}")
        if problems:
            raise SshdError("\n".join(problems))

    # -- use --------------------------------------------------------------------------

    def host(self, name: str) -> Host:
        """The host called ``name``."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def ssh_command(self) -> list[str]:
        """``ssh`` with our config (known hosts of our own; nothing read from ``~/.ssh``)."""
        return ["ssh", "-F", str(self.ssh_config)]

    def launcher_env(self, ssh_options: Sequence[str] = (), **extra: str) -> dict[str, str]:
        """This process's environment plus ``extra``, and ``HORA_SSH_COMMAND`` naming our
        ssh config (and ``ssh_options``, which come before hora's own and so win)."""
        command = [*self.ssh_command(), *ssh_options]
        return {**os.environ, "HORA_SSH_COMMAND": shlex.join(command), **extra}

    def launcher_flags(self) -> list[str]:
        """horovodrun's own ssh flags for these hosts: port and identity file."""
        return ["--ssh-port", str(self.port), "--ssh-identity-file", str(self.key)]

    def link(self, host: Host, up: bool) -> None:
        """Takes ``host``'s link down (nothing is closed: its packets just stop) or up."""
        _run(["ip", "-n", host.namespace, "link", "set", "eth0", "up" if up else "down"])

    def pids(self, host: Host) -> list[int]:
        """Every process in ``host``'s network namespace."""
        try:
            out = _run(["ip", "netns", "pids", host.namespace])
        except SshHostsUnavailable:
            return []
        return [int(p) for p in out.split()]

    def processes(self, host: Host) -> list[str]:
        """``pid command line`` of every process on ``host`` except its sshd listener."""
        listener = host.sshd.pid if host.sshd is not None else None
        found = []
        for pid in self.pids(host):
            if pid == listener:
                continue
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue  # gone meanwhile
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            command = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(f"{pid} {command}")
        return found

    def wait_no_processes(self, hosts: Sequence[Host], timeout: float) -> dict[str, list[str]]:
        """Waits until ``hosts`` run nothing but their sshd listener; returns what is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = {h.name: self.processes(h) for h in hosts}
            left = {name: procs for name, procs in left.items() if procs}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def sshd_log(self, host: Host) -> str:
        """The tail of ``host``'s sshd log."""
        log = self._logs.get(host.name)
        if log is None or not log.exists():
            return "(no log)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-20:])

    # -- tear-down --------------------------------------------------------------------

    def _kill_all(self, namespace: str) -> None:
        for _ in range(3):
            try:
                pids = [int(p) for p in _run(["ip", "netns", "pids", namespace]).split()]
            except SshHostsUnavailable:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def close(self) -> None:
        """Kills what runs in the namespaces, deletes them and their /etc/netns entries.

        Idempotent, and safe after a failed :meth:`start`.
        """
        for host in self.hosts:
            self.stop_sshd(host)
        for namespace in reversed(self._namespaces):
            self._kill_all(namespace)
        for host in [self.client, *self.hosts]:
            if host.sshd is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.sshd.wait(5)
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True,
                           timeout=_IP_TIMEOUT, check=False)
        self._namespaces.clear()
        for etc in self._etc_dirs:
            shutil.rmtree(etc, ignore_errors=True)
        self._etc_dirs.clear()
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only when empty: others may use it

    def namespaces(self) -> Iterator[str]:
        """The names of every namespace made (for diagnostics)."""
        yield from self._namespaces


@contextlib.contextmanager
def running_hosts(workdir: Path, count: int, skip: Callable[[str], object]) -> Iterator[SshHosts]:
    """Started :class:`SshHosts`, closed on leaving: a test fixture's body.

    ``skip(reason)`` is called, and must raise (``pytest.skip``), when this
    machine cannot make the namespaces; an sshd that fails raises :class:`SshdError`.
    """
    cluster = SshHosts(workdir, count=count)
    try:
        cluster.start()
    except SshHostsUnavailable as exc:
        skip(str(exc))
        raise
    except SshdError:
        cluster.close()
        raise
    try:
        yield cluster
    finally:
        cluster.close()
