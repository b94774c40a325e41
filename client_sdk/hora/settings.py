"""Worker settings: the one place a worker's configuration is read.

The options themselves (names, units, defaults, environment names, flags)
are declared once, in :data:`hora_proto.options.OPTIONS`; this module makes
the worker's frozen view of them. The launcher turns its flags into
``HORA_*`` environment variables for the workers; a worker reads the
environment once, in :func:`Settings.from_env`, and passes the frozen
result down. Horovod's ``HOROVOD_*`` names are
accepted as aliases so that an unchanged Horovod job configuration keeps
working; when both are set the ``HORA_*`` name wins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hora._net import interface_address, route_source
from hora_proto.options import (
    BY_FIELD,
    JOB_LEVEL,
    LAUNCHER_ONLY,
    LOG_LEVELS,
    OPTIONS,
    MiB,
    Option,
    OptionError,
    env_value,
    format_value,
    job_options,
    parse_bool,
)

__all__ = ["Settings", "SettingsError", "ENV_VARS", "LOG_LEVELS", "MiB",
           "STALL_CHECK_DISABLE_VARS", "configure_logging"]


class SettingsError(ValueError):
    """An environment variable or flag has a value hora cannot use."""


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


#: The options a worker reads (:data:`hora_proto.options.OPTIONS` less the
#: launcher's own); the launcher passes each on under its first name.
ENV_VARS: tuple[Option, ...] = tuple(o for o in OPTIONS if o.field not in LAUNCHER_ONLY)


def _default(name: str) -> Any:
    """The dataclass field of option ``name``, with the table's default."""
    option = BY_FIELD[name]
    if option.default_factory is not None:
        return dataclasses.field(default_factory=option.default_factory)
    return dataclasses.field(default=option.default)


@dataclass(frozen=True)
class Settings:
    """Everything a worker needs to know.

    Each field's meaning, unit, default and environment names are in
    :data:`hora_proto.options.OPTIONS`; only its Python type is written here.
    """

    coordinator: str = _default("coordinator")
    job_id: str = _default("job_id")
    token: str = _default("token")
    tls_ca: str = _default("tls_ca")
    size: int = _default("size")
    rank: int = _default("rank")
    hostname: str = _default("hostname")
    data_plane_address: str = _default("data_plane_address")
    network_interface: str = _default("network_interface")
    start_timeout: timedelta = _default("start_timeout")
    connect_timeout: timedelta = _default("connect_timeout")
    coordinator_outage_timeout: timedelta = _default("coordinator_outage_timeout")
    collective_timeout: timedelta = _default("collective_timeout")
    heartbeat_interval: timedelta = _default("heartbeat_interval")
    stall_warning_time: timedelta = _default("stall_warning_time")
    stall_shutdown_time: timedelta = _default("stall_shutdown_time")
    fusion_threshold: int = _default("fusion_threshold")
    cycle_time: timedelta = _default("cycle_time")
    cache_capacity: int = _default("cache_capacity")
    mesh_allreduce_bytes: int = _default("mesh_allreduce_bytes")
    shm_allreduce_bytes: int = _default("shm_allreduce_bytes")
    gradient_views: bool = _default("gradient_views")
    native_hooks: bool = _default("native_hooks")
    timeline: str = _default("timeline")
    timeline_mark_cycles: bool = _default("timeline_mark_cycles")
    autotune: bool = _default("autotune")
    autotune_log: str = _default("autotune_log")
    autotune_warmup_samples: int | None = _default("autotune_warmup_samples")
    autotune_max_samples: int | None = _default("autotune_max_samples")
    log_level: str = _default("log_level")
    log_hide_time: bool = _default("log_hide_time")
    reset_limit: int | None = _default("reset_limit")
    min_size: int = _default("min_size")
    max_size: int = _default("max_size")
    elastic_timeout: timedelta = _default("elastic_timeout")

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
        for option in ENV_VARS:
            try:
                value = env_value(env, option)
            except OptionError as exc:
                raise SettingsError(str(exc)) from exc
            if value is not None:
                values[option.field] = value
        for name in STALL_CHECK_DISABLE_VARS:
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            try:
                disabled = parse_bool(raw)
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
        return {option.names[0]: format_value(option, getattr(self, option.field))
                for option in ENV_VARS if getattr(self, option.field) is not None}

    def job_options(self) -> dict[str, str]:
        """The job-level options, as this worker sends them when it joins."""
        return job_options({o.field: getattr(self, o.field) for o in JOB_LEVEL})
