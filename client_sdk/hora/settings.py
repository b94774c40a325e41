"""Worker settings: the one place a worker's configuration is read.

The launcher turns its flags into ``HORA_*`` environment variables for the
workers; a worker reads the environment once, in :func:`Settings.from_env`,
and passes the frozen result down. Horovod's ``HOROVOD_*`` names are
accepted as aliases so that an unchanged Horovod job configuration keeps
working; when both are set the ``HORA_*`` name wins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hora._net import interface_address, route_source

__all__ = ["Settings", "SettingsError", "ENV_VARS", "STALL_CHECK_DISABLE_VARS",
           "configure_logging"]

MiB = 1024 * 1024


class SettingsError(ValueError):
    """An environment variable or flag has a value hora cannot use."""


def _seconds(text: str) -> timedelta:
    return timedelta(seconds=float(text))


def _millis(text: str) -> timedelta:
    return timedelta(milliseconds=float(text))


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


# Python's names and Horovod's (TRACE, FATAL).
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL", "CRITICAL")

# Horovod's switch for the stall check (``--no-stall-check`` in the
# launcher); set, it turns both stall times off. First name wins.
STALL_CHECK_DISABLE_VARS = ("HORA_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE")


def _logging_level(name: str) -> int | None:
    """The :mod:`logging` level of a hora or Horovod level name, None if unknown."""
    upper = name.strip().upper()
    if upper not in LOG_LEVELS:
        return None
    return logging.getLevelName({"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(upper, upper))


class _HoraHandler(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]
    """The handler :func:`configure_logging` installs; its class marks it as ours."""


def configure_logging(settings: Settings) -> None:
    """Makes a configured ``log_level`` visible: hora's messages at that level go to stderr.

    Horovod prints its backend's log lines at ``HOROVOD_LOG_LEVEL`` itself;
    hora's go through :mod:`logging`, whose default handler shows only
    warnings. So when a level is set, the ``hora`` logger gets that level and
    one stderr handler (never a second one, however often ``init()`` runs).
    With no level set nothing changes: the application's own logging
    configuration, or Python's default, applies.
    """
    if not settings.log_level:
        return
    level = _logging_level(settings.log_level)
    if level is None:
        raise SettingsError(f"unknown log level {settings.log_level!r}")
    logger = logging.getLogger("hora")
    logger.setLevel(level)
    handler = next((h for h in logger.handlers if isinstance(h, _HoraHandler)), None)
    if handler is None:
        handler = _HoraHandler(sys.stderr)
        logger.addHandler(handler)
    layout = "%(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(layout if settings.log_hide_time
                                           else "%(asctime)s " + layout))


@dataclass(frozen=True)
class _Var:
    field: str
    names: tuple[str, ...]
    parse: Callable[[str], Any]
    help: str


# Field, environment names (first wins), parser, meaning. The launcher uses
# the first name of each entry when it passes settings to workers.
ENV_VARS: tuple[_Var, ...] = (
    _Var("coordinator", ("HORA_COORDINATOR",), str, "coordinator gRPC address HOST:PORT"),
    _Var("job_id", ("HORA_JOB_ID",), str, "job the worker joins"),
    _Var("token", ("HORA_TOKEN",), str, "job token sent with every gRPC call"),
    _Var("tls_ca", ("HORA_TLS_CA",), str,
         "CA bundle (PEM) that verifies the coordinator's TLS certificate, as a file path or "
         "the PEM text itself; unset: plaintext"),
    _Var("size", ("HORA_SIZE", "HOROVOD_SIZE"), int, "world size the launcher started"),
    _Var("rank", ("HORA_RANK", "HOROVOD_RANK"), int, "rank the launcher assigned"),
    _Var("hostname", ("HORA_HOSTNAME", "HOROVOD_HOSTNAME"), str, "host name for local ranks"),
    _Var("data_plane_address", ("HORA_DATA_PLANE_ADDRESS",), str,
         "address the data plane binds to; 'auto': the one that reaches the coordinator"),
    _Var("network_interface", ("HORA_NETWORK_INTERFACE",), str,
         "network interface whose address the data plane binds to (overrides the address)"),
    _Var("start_timeout", ("HORA_START_TIMEOUT", "HOROVOD_START_TIMEOUT"), _seconds,
         "seconds to wait for the world to gather"),
    _Var("connect_timeout", ("HORA_CONNECT_TIMEOUT",), _seconds,
         "seconds to wait for the coordinator to answer at init"),
    _Var("coordinator_outage_timeout", ("HORA_COORDINATOR_OUTAGE_TIMEOUT",), _seconds,
         "seconds a worker trains on without the coordinator (it restarts, the network "
         "drops) before what needs it fails"),
    _Var("collective_timeout", ("HORA_COLLECTIVE_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS"),
         _seconds, "seconds a data-plane collective may take"),
    _Var("heartbeat_interval", ("HORA_HEARTBEAT_INTERVAL",), _seconds,
         "seconds between heartbeats when the coordinator names none (it sizes them to "
         "its load)"),
    _Var("stall_warning_time", ("HORA_STALL_CHECK_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS"),
         _seconds, "seconds a tensor may wait on some ranks before a warning"),
    _Var("stall_shutdown_time",
         ("HORA_STALL_SHUTDOWN_TIME", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"), _seconds,
         "seconds a tensor may wait on some ranks before the job fails (0: never)"),
    _Var("fusion_threshold", ("HORA_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"), int,
         "largest fusion buffer in bytes (0 disables fusion)"),
    _Var("cycle_time", ("HORA_CYCLE_TIME", "HOROVOD_CYCLE_TIME"), _millis,
         "milliseconds the background loop batches ready tensors"),
    _Var("cache_capacity", ("HORA_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"), int,
         "negotiated allreduces remembered so they skip the coordinator (0 disables)"),
    _Var("mesh_allreduce_bytes", ("HORA_MESH_ALLREDUCE_BYTES",), int,
         "cached CPU allreduces up to this many bytes (times ranks - 1) travel with the "
         "round's agreement over direct connections instead of Gloo; with 2 or 4 ranks "
         "that share no memory, larger ones go by swaps between pairs of ranks over those "
         "connections (0: always Gloo)"),
    _Var("shm_allreduce_bytes", ("HORA_SHM_ALLREDUCE_BYTES",), int,
         "when all ranks share a machine, cached CPU allreduces up to this many bytes per "
         "round go through shared memory instead of sockets (0: never)"),
    _Var("timeline", ("HORA_TIMELINE", "HOROVOD_TIMELINE"), str,
         "Chrome-trace timeline file written by rank 0"),
    _Var("timeline_mark_cycles", ("HORA_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES"),
         _bool, "mark each agreement round in the timeline"),
    _Var("autotune", ("HORA_AUTOTUNE", "HOROVOD_AUTOTUNE"), _bool,
         "tune fusion threshold and cycle time online"),
    _Var("autotune_log", ("HORA_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG"), str,
         "CSV log of the settings autotune tried"),
    _Var("autotune_warmup_samples",
         ("HORA_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"), int,
         "autotune: measurement windows discarded before tuning starts"),
    _Var("autotune_max_samples",
         ("HORA_AUTOTUNE_MAX_SAMPLES", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"), int,
         "autotune: settings measured before the best one is kept"),
    _Var("log_level", ("HORA_LOG_LEVEL", "HOROVOD_LOG_LEVEL"), str,
         "logging level; when set, hora's messages at that level and above go to stderr"),
    _Var("log_hide_time", ("HORA_LOG_HIDE_TIME", "HOROVOD_LOG_HIDE_TIME"), _bool,
         "leave the timestamp out of hora's log messages"),
    _Var("reset_limit", ("HORA_RESET_LIMIT", "HOROVOD_RESET_LIMIT"), int,
         "elastic resets a worker may go through (unset: no limit)"),
    _Var("min_size", ("HORA_MIN_SIZE",), int, "elastic: fewest workers the job runs with"),
    _Var("max_size", ("HORA_MAX_SIZE",), int, "elastic: most workers the job runs with"),
    _Var("elastic_timeout", ("HORA_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT"), _seconds,
         "elastic: seconds a round may wait for min_size workers"),
)


@dataclass(frozen=True)
class Settings:
    """Everything a worker needs to know, with defaults in one place."""

    coordinator: str = ""
    job_id: str = "default"
    token: str = ""
    # Empty: a plaintext channel to the coordinator (see hora._tls).
    tls_ca: str = ""
    size: int = 1
    rank: int = -1
    hostname: str = dataclasses.field(default_factory=socket.gethostname)
    data_plane_address: str = "127.0.0.1"
    network_interface: str = ""
    start_timeout: timedelta = timedelta(seconds=60)
    connect_timeout: timedelta = timedelta(seconds=15)
    coordinator_outage_timeout: timedelta = timedelta(seconds=60)
    collective_timeout: timedelta = timedelta(seconds=300)
    heartbeat_interval: timedelta = timedelta(seconds=1)
    stall_warning_time: timedelta = timedelta(seconds=60)
    # Every wait has a deadline: a tensor some live rank never submits fails
    # the job after this long (Horovod's default is never; 0 restores that).
    stall_shutdown_time: timedelta = timedelta(minutes=30)
    fusion_threshold: int = 128 * MiB
    # Rounds start as soon as a tensor is ready: measured faster here than
    # waiting to batch more (see bench/README.md).
    cycle_time: timedelta = timedelta(0)
    cache_capacity: int = 1024
    # Small allreduces ride the agreement round's own exchange: one round trip
    # instead of two exchanges (see bench/README.md for the measurement).
    mesh_allreduce_bytes: int = 1 * MiB
    # Ranks on one machine read each other's tensors in place: about 4 memory
    # passes instead of a trip through loopback TCP (see bench/README.md).
    shm_allreduce_bytes: int = 64 * MiB
    timeline: str = ""
    timeline_mark_cycles: bool = False
    autotune: bool = False
    autotune_log: str = ""
    # None: the autotuner's own defaults.
    autotune_warmup_samples: int | None = None
    autotune_max_samples: int | None = None
    # Empty: not configured, so hora installs no log handler of its own and
    # Python's defaults apply (warnings and errors reach stderr).
    log_level: str = ""
    log_hide_time: bool = False
    reset_limit: int | None = None
    min_size: int = 0
    max_size: int = 0
    elastic_timeout: timedelta = timedelta(seconds=600)

    def with_reachable_address(self) -> Settings:
        """These settings with ``data_plane_address`` made concrete.

        A named ``network_interface`` gives its address; ``auto`` gives the
        address this machine uses to reach the coordinator (a job that spans
        machines); anything else is kept.

        Raises:
            SettingsError: the interface has no IPv4 address, or the
                coordinator's host cannot be resolved.
        """
        if self.network_interface:
            try:
                address = interface_address(self.network_interface)
            except ValueError as exc:
                raise SettingsError(f"HORA_NETWORK_INTERFACE: {exc}") from None
        elif self.data_plane_address == "auto":
            host = self.coordinator.rpartition(":")[0].strip("[]") or "127.0.0.1"
            try:
                address = route_source(host)
            except OSError as exc:
                raise SettingsError(
                    f"HORA_DATA_PLANE_ADDRESS=auto: no route to the coordinator's host "
                    f"{host!r}: {exc}") from None
        else:
            return self
        return dataclasses.replace(self, data_plane_address=address)

    @property
    def is_elastic(self) -> bool:
        """Whether the job is elastic: min or max size given (the coordinator's rule too)."""
        return self.min_size > 0 or self.max_size > 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Reads settings from ``environ`` (default ``os.environ``).

        Raises:
            SettingsError: a variable is set to a value that does not parse,
                naming the variable and the value.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var in ENV_VARS:
            for name in var.names:
                raw = env.get(name)
                if raw is None or raw == "":
                    continue
                try:
                    values[var.field] = var.parse(raw)
                except ValueError as exc:
                    raise SettingsError(f"{name}={raw!r}: {var.help}: {exc}") from exc
                break
        for name in STALL_CHECK_DISABLE_VARS:
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            try:
                disabled = _bool(raw)
            except ValueError as exc:
                raise SettingsError(f"{name}={raw!r}: disables the stall check: {exc}") from exc
            if disabled:
                # Horovod's switch wins over the stall times, as in Horovod.
                values["stall_warning_time"] = timedelta(0)
                values["stall_shutdown_time"] = timedelta(0)
            break
        values.update(overrides)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raises SettingsError when a value is out of its range."""
        if self.size < 1:
            raise SettingsError(f"size must be at least 1, got {self.size}")
        if self.rank >= max(self.size, self.max_size):
            raise SettingsError(f"rank {self.rank} is outside a world of size {self.size}")
        if self.min_size and not 1 <= self.min_size <= (self.max_size or self.min_size):
            raise SettingsError(
                f"elastic sizes need 1 <= min_size <= max_size, got {self.min_size} and "
                f"{self.max_size}")
        if self.cache_capacity < 0:
            raise SettingsError(f"cache capacity must be >= 0, got {self.cache_capacity}")
        if self.cycle_time < timedelta(0):
            raise SettingsError(f"cycle time must be >= 0, got {self.cycle_time}")
        for name in ("mesh_allreduce_bytes", "shm_allreduce_bytes"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.fusion_threshold < 0:
            raise SettingsError(f"fusion threshold must be >= 0, got {self.fusion_threshold}")
        for name in ("autotune_warmup_samples", "autotune_max_samples"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "autotune_warmup_samples" else 1):
                raise SettingsError(f"{name} is out of range, got {value}")
        if self.log_level and _logging_level(self.log_level) is None:
            raise SettingsError(
                f"log level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for name in ("start_timeout", "connect_timeout", "collective_timeout",
                     "heartbeat_interval", "coordinator_outage_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise SettingsError(f"{name} must be positive, got {getattr(self, name)}")

    def to_env(self) -> dict[str, str]:
        """The ``HORA_*`` variables that reproduce these settings in a worker."""
        out: dict[str, str] = {}
        for var in ENV_VARS:
            value = getattr(self, var.field)
            if value is None:
                continue
            if isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, timedelta):
                seconds = value.total_seconds()
                text = str(seconds * 1000.0) if var.parse is _millis else str(seconds)
            else:
                text = str(value)
            out[var.names[0]] = text
        return out
