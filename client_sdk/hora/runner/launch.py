"""``horarun``: start a coordinator and N workers, and supervise them.

    horarun -np 2 python train.py --epochs 3

Steps: parse the command line (:mod:`.args`), place ranks on hosts
(:mod:`.hosts`), embed a coordinator unless ``--coordinator`` names one,
build each worker's environment (:mod:`.env`), then start and supervise the
workers (:mod:`.supervisor`, as :mod:`.fixed` decides). Exit codes: 0 when
all workers succeed, the first failing worker's code otherwise (128+N for
signal N), 130/143 when ``horarun`` is interrupted, 2 for usage errors, 1
when the embedded coordinator cannot start or a remote host does not answer
over ssh.

At start it prints where the coordinator listens and the URL of the job's
page on the dashboard the coordinator serves (:func:`_dashboard_line`).

Hosts that are not this machine run their workers over ssh (:mod:`.remote`);
such a job's coordinator and data planes listen on a routable address
instead of loopback (:func:`_network`).

An elastic job (``--min-np``/``--max-np``/``--host-discovery-script``) takes
its hosts from a discovery script (:mod:`.discovery`) or a fixed ``-H`` list,
and is supervised by :mod:`.supervisor` following the decisions of
:mod:`.elastic` (wired by :mod:`.elastic_driver`); it exits 1 when it cannot
keep ``--min-np`` workers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from .._net import interface_address, route_source
from .._shm import remove_leftovers
from .args import LaunchConfig, parse_address, parse_args
from .discovery import HostPoller, run_discovery_script
from .elastic import ElasticPlanner, ElasticPolicy, StartWorker
from .elastic_driver import ElasticDriver
from .embedded import start_embedded_coordinator
from .env import elastic_worker_environment, worker_environment
from .fixed import FixedPlanner, WorkerSpec
from .hosts import (
    HostError,
    HostSlots,
    SlotInfo,
    assign_ranks,
    is_local_host,
    is_loopback_host,
    parse_hostfile,
    parse_hosts,
)
from .output import WorkerOutput
from .remote import RemoteShell, UnreachableHostError
from .supervisor import Supervisor
from .tls import JobCertificates, make_job_certificates
from .watch import CoordinatorWatch

__all__ = ["horovodrun_main", "main", "resolve_hosts"]

USAGE_ERROR = 2
COORDINATOR_ERROR = 1
UNREACHABLE_HOST = 1


class _UsageError(Exception):
    """A request that parses but cannot be carried out as given (exit 2)."""


def _err(message: str) -> None:
    print(f"horarun: {message}", file=sys.stderr, flush=True)


def resolve_hosts(config: LaunchConfig) -> list[HostSlots]:
    """The hosts to run on: ``-H``, ``--hostfile``, or ``localhost`` with N slots.

    Raises:
        HostError: the host list or hostfile is malformed or unreadable.
    """
    if config.hosts_arg is not None:
        return parse_hosts(config.hosts_arg)
    if config.hostfile is not None:
        try:
            with open(config.hostfile, encoding="utf-8") as f:
                return parse_hostfile(f, name=config.hostfile)
        except OSError as exc:
            raise HostError(f"--hostfile: cannot read {config.hostfile!r}: "
                            f"{exc.strerror or exc}") from exc
    return [HostSlots("localhost", config.num_proc)]


def _placement(config: LaunchConfig) -> list[SlotInfo]:
    try:
        return assign_ranks(resolve_hosts(config), config.num_proc)
    except HostError as exc:
        raise _UsageError(str(exc)) from exc


@dataclass(frozen=True)
class _Network:
    """Where the job's processes listen: loopback on one machine, else routable.

    Attributes:
        remote: how to start workers on other machines; None keeps the job
            on this machine (and every listener on loopback).
        host: the address of this machine the others reach: the embedded
            coordinator binds to it, and workers here listen on it.
        interface: the interface every machine listens on, if named.
    """

    remote: RemoteShell | None = None
    host: str = "127.0.0.1"
    interface: str | None = None

    def worker_settings(self, hostname: str) -> dict[str, Any]:
        """The data-plane settings of a worker on ``hostname``."""
        if self.remote is None:
            return {}
        if self.interface is not None:
            return {"network_interface": self.interface}
        # Here the address is known; elsewhere the worker finds its own.
        return {"data_plane_address": self.host if is_local_host(hostname) else "auto"}


def _facing(host: str) -> str:
    """This machine's address toward ``host``; when ``host`` does not resolve here
    (an alias in ~/.ssh/config, say), the address of the default route.

    Raises:
        OSError: neither exists.
    """
    try:
        return route_source(host)
    except OSError:
        # TEST-NET-1: never routed anywhere, so this only asks for the default route.
        return route_source("192.0.2.1")


def _network(config: LaunchConfig, hostnames: Iterable[str]) -> _Network:
    """Decides how the job's machines reach each other.

    A job spans machines when a host is not this one, or when
    ``--network-interface`` says so (an elastic job that may discover other
    machines). Then the coordinator listens on this machine's address of
    that interface, or on its address toward the first remote host, and
    every worker's data plane on its own machine's address.

    Raises:
        _UsageError: the interface has no address here, no route leads to
            the first remote host, or ``--coordinator`` is on loopback.
    """
    remote_hosts = sorted({name for name in hostnames if not is_local_host(name)})
    nic = config.network_interface
    if not remote_hosts and nic is None:
        return _Network()
    if config.coordinator is not None and remote_hosts:
        host = parse_address(config.coordinator)[0]
        if is_loopback_host(host):
            raise _UsageError(
                f"--coordinator {config.coordinator} is a loopback address, which workers on "
                f"{remote_hosts[0]} cannot reach; give an address of its machine that they can")
    try:
        address = interface_address(nic) if nic is not None else _facing(remote_hosts[0])
    except ValueError as exc:
        raise _UsageError(f"--network-interface {nic}: {exc}") from exc
    except OSError as exc:
        raise _UsageError(
            f"host {remote_hosts[0]} is not this machine, and no address of this machine "
            f"reaches it ({exc}); name the interface to use with --network-interface") from exc
    remote = RemoteShell.from_env(port=config.ssh_port, identity_file=config.ssh_identity_file)
    return _Network(remote, address, nic)


def _elastic_hosts(config: LaunchConfig,
                   elastic: ElasticPolicy) -> Callable[[], list[HostSlots]]:
    """Where the elastic job's hosts come from: the script, or the fixed list.

    Raises:
        _UsageError: the fixed list is malformed, names a remote host, or
            has fewer slots than ``--min-np``.
    """
    if elastic.discovery_script is not None:
        return functools.partial(run_discovery_script, elastic.discovery_script,
                                 elastic.slots_per_host)
    try:
        hosts = resolve_hosts(config)
    except HostError as exc:
        raise _UsageError(str(exc)) from exc
    total = sum(h.slots for h in hosts)
    if total < elastic.min_np:
        raise _UsageError(f"--min-np {elastic.min_np} needs {elastic.min_np} slots but the "
                          f"hosts have only {total}; add slots with -H host:N or lower "
                          f"--min-np")
    return lambda: hosts


def _start_coordinator(config: LaunchConfig, bind_host: str,
                       certificates: JobCertificates | None) -> Any:
    files = None if certificates is None else (certificates.cert_file, certificates.key_file)
    return start_embedded_coordinator(bind_host, config.token, config.coordinator_http_port,
                                      files)


def _compat_env(base: dict[str, str]) -> dict[str, str]:
    """Puts the ``horovod`` shim first on the workers' ``PYTHONPATH``.

    Raises:
        _UsageError: a real Horovod is installed; shadowing it silently would
            run the user's script on something they did not choose.
    """
    from hora._compat import real_horovod_location, shim_path

    real = real_horovod_location()
    if real is not None:
        raise _UsageError(
            f"a real Horovod is installed ({real}); hora will not shadow it. Run it with "
            f"its own horovodrun, or change the script to `import hora.torch as hvd` and "
            f"use horarun without --horovod-compat")
    paths = [shim_path()] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**base, "PYTHONPATH": os.pathsep.join(paths)}


def _base_env(config: LaunchConfig) -> dict[str, str]:
    base = {**os.environ, **config.worker_env}
    # Workers get the job's CA (or none) from the launcher only: an inherited one
    # would make them try TLS against a plaintext coordinator.
    base.pop("HORA_TLS_CA", None)
    if config.horovod_compat:
        base = _compat_env(base)
    return base


def _tls_settings(tls_ca: str) -> dict[str, Any]:
    return {"tls_ca": tls_ca} if tls_ca else {}


def _specs(config: LaunchConfig, slots: Sequence[SlotInfo], coordinator: str,
           network: _Network, tls_ca: str) -> list[WorkerSpec]:
    base = _base_env(config)
    return [
        WorkerSpec(
            rank=slot.rank,
            hostname=slot.hostname,
            argv=config.command,
            env=worker_environment(
                base, slot,
                coordinator=coordinator,
                job_id=config.job_id,
                token=config.token,
                worker_settings={**config.worker_settings,
                                 **network.worker_settings(slot.hostname),
                                 **_tls_settings(tls_ca)},
            ),
        )
        for slot in slots
    ]


def _run_elastic(config: LaunchConfig, elastic: ElasticPolicy,
                 find_hosts: Callable[[], list[HostSlots]], coordinator: str,
                 network: _Network, tls_ca: str) -> int:
    # Here, not at module level: a static job never needs gRPC in this process.
    from .events import EventReporter, GenerationWatch

    base = _base_env(config)

    def make_env(start: StartWorker) -> dict[str, str]:
        return elastic_worker_environment(
            base, start.host,
            size=config.num_proc,
            coordinator=coordinator,
            job_id=config.job_id,
            token=config.token,
            worker_settings={**config.worker_settings, **network.worker_settings(start.host),
                             **_tls_settings(tls_ca)},
            placement=start.placement,
        )

    output = WorkerOutput(prefix=config.prefix, output_dir=config.output_dir,
                          remote=network.remote, timestamp=config.prefix_timestamp)
    planner = ElasticPlanner(dataclasses.replace(elastic, num_proc=config.num_proc))
    poller = HostPoller(find_hosts, say=output.say)
    reporter = EventReporter(coordinator, config.job_id, config.token, tls_ca=tls_ca,
                             say=output.say)
    try:
        same_clock = is_local_host(parse_address(coordinator)[0])
        generations = (GenerationWatch(reporter.generation)
                       if elastic.reset_limit is not None else None)
        return ElasticDriver(planner, poller, make_env, config.command, output=output,
                             reporter=reporter, generations=generations,
                             verbose=config.verbose,
                             same_clock=same_clock).run()
    finally:
        # Before the embedded coordinator stops, so the last events land.
        reporter.close()


def _startup_line(config: LaunchConfig, network: _Network, address: str,
                  http_port: int) -> str:
    """What ``horarun`` says about the coordinator it embeds.

    Off loopback the REST API wants the job token; when ``horarun`` made the
    token up, nobody else knows it, so the line shows it as Jupyter does.
    """
    scheme = "https" if config.tls else "http"
    line = (f"coordinator gRPC {address}{' (TLS)' if config.tls else ''}, "
            f"HTTP {scheme}://{network.host}:{http_port}, job {config.job_id}")
    if is_loopback_host(network.host):
        return line
    if config.token_made_up:
        return (f"{line}; the HTTP API wants the job token: "
                f"{scheme}://{network.host}:{http_port}/api/v1/jobs?token={config.token}")
    return f"{line}; the HTTP API wants the job token (Authorization: Bearer TOKEN)"


def _dashboard_line(config: LaunchConfig, host: str, http_port: int | None, tls: bool,
                    embedded: bool) -> str:
    """Where the job's page of the dashboard is: the coordinator serves it at ``/jobs/ID``.

    ``http_port`` is None for a running ``--coordinator`` whose HTTP port
    horarun was not told (``--coordinator-http-port``): its gRPC address says
    nothing about it. Off loopback the page wants the job token; a made-up
    one is only in this line (as in the coordinator line), a given one the
    user knows, and the page asks for it.
    """
    page = "/jobs/" + quote(config.job_id, safe="")
    if http_port is None:
        return (f"dashboard: page {page} on the coordinator's HTTP address (hora-coordinator "
                f"prints it at start; pass --coordinator-http-port PORT and horarun prints "
                f"the whole URL)")
    name = f"[{host}]" if ":" in host else host
    url = f"{'https' if tls else 'http'}://{name}:{http_port}{page}"
    if is_loopback_host(host):
        return f"dashboard {url}"
    if embedded and config.token_made_up:
        return f"dashboard {url}?token={config.token}"
    return f"dashboard {url} (it asks for the job token once)"


def horovodrun_main(argv: Sequence[str] | None = None) -> int:
    """Runs ``horovodrun``: ``horarun`` with the ``horovod`` import shim on by default."""
    return main(argv, prog="horovodrun", horovod_compat=True)


def main(argv: Sequence[str] | None = None, *, prog: str = "horarun",
         horovod_compat: bool = False) -> int:
    """Runs ``horarun``.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).
        prog: the program name in messages.
        horovod_compat: the default of ``--horovod-compat``.

    Returns:
        The process exit code (see the module docstring).
    """
    try:
        config = parse_args(argv, prog=prog, horovod_compat=horovod_compat)
    except SystemExit as exc:
        # argparse has printed usage already; return rather than raise so
        # callers embedding main() get a code, not an exception.
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR

    for notice in config.notices:
        _err(notice)
    elastic = config.elastic
    slots: list[SlotInfo] = []
    find_hosts: Callable[[], list[HostSlots]] | None = None
    try:
        if elastic is None:
            slots = _placement(config)
            hostnames = [slot.hostname for slot in slots]
        else:
            find_hosts = _elastic_hosts(config, elastic)
            # A fixed list is known now; a discovery script's hosts are not.
            hostnames = [] if elastic.discovery_script is not None else \
                [host.hostname for host in find_hosts()]
        network = _network(config, hostnames)
    except _UsageError as exc:
        _err(f"error: {exc}")
        return USAGE_ERROR

    if elastic is not None and config.verbose:
        upper = elastic.max_np if elastic.max_np is not None else "unlimited"
        source = (f"discovery script {elastic.discovery_script!r}"
                  if elastic.discovery_script is not None else "a fixed host list")
        _err(f"elastic job: {config.num_proc} workers to start, at least {elastic.min_np}, "
             f"at most {upper}; hosts from {source}")
    if config.verbose:
        for slot in slots:
            _err(f"rank {slot.rank} on {slot.hostname} (local {slot.local_rank}/"
                 f"{slot.local_size}, cross {slot.cross_rank}/{slot.cross_size})")

    coordinator = None
    watch: CoordinatorWatch | None = None
    certificates: JobCertificates | None = None
    address = config.coordinator
    tls_ca = config.tls_ca
    try:
        if network.remote is not None:
            try:
                network.remote.check(name for name in hostnames if not is_local_host(name))
            except UnreachableHostError as exc:
                _err(f"error: {exc}")
                return UNREACHABLE_HOST
        if address is None:
            try:
                if config.tls:
                    certificates = make_job_certificates([network.host])
                    tls_ca = certificates.ca_pem.decode("ascii")
                coordinator = _start_coordinator(config, network.host, certificates)
            except Exception as exc:  # any failure here means "cannot embed"
                _err(f"error: cannot start the embedded coordinator: "
                     f"{type(exc).__name__}: {exc}; start one with hora-coordinator "
                     f"and pass --coordinator HOST:PORT")
                return COORDINATOR_ERROR
            address = coordinator.grpc_address
            _err(_startup_line(config, network, address, coordinator.http_port))
            _err(_dashboard_line(config, network.host, coordinator.http_port, config.tls,
                                 embedded=True))
        else:
            _err(_dashboard_line(config, parse_address(address)[0],
                                 config.coordinator_http_port or None, bool(tls_ca),
                                 embedded=False))
            # Workers may start before it is reachable (they retry within their
            # connect timeout), so no check is made here; an outage later is reported.
            watch = CoordinatorWatch(address, _err, tls_ca).start()
        try:
            if elastic is not None and find_hosts is not None:
                return _run_elastic(config, elastic, find_hosts, address, network, tls_ca)
            specs = _specs(config, slots, address, network, tls_ca)
        except _UsageError as exc:
            _err(f"error: {exc}")
            return USAGE_ERROR
        output = WorkerOutput(prefix=config.prefix, output_dir=config.output_dir,
                              remote=network.remote, timestamp=config.prefix_timestamp)
        return Supervisor(FixedPlanner(specs), output).run()
    except KeyboardInterrupt:
        # Ctrl-C before the workers (and our handlers) were in place.
        return 130
    finally:
        if watch is not None:
            watch.stop()
        if coordinator is not None:
            coordinator.stop()
        if certificates is not None:
            shutil.rmtree(certificates.directory, ignore_errors=True)
        # Every worker has exited: shared segments a killed one left behind.
        removed = remove_leftovers(config.job_id)
        if removed and config.verbose:
            _err(f"removed {len(removed)} shared-memory file(s) left by killed workers")

if __name__ == "__main__":
    sys.exit(main())
