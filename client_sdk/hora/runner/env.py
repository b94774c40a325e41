"""The environment each worker starts with.

Configuration reaches a worker only through the ``HORA_*`` variables of
:data:`hora.settings.ENV_VARS` (their first names) and through the
``HOROVOD_*`` variables that Horovod scripts read directly
(``HOROVOD_RANK`` and friends). The values are formatted by
:meth:`hora.settings.Settings.to_env`, so the launcher and the worker agree
on units by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hora.settings import ENV_VARS, Settings

from .hosts import SlotInfo, data_plane_address

__all__ = ["PER_RANK_FIELDS", "worker_environment"]

# Settings fields every worker is given, whatever the flags; the others are
# passed only when a flag set them, so a worker's own defaults (or variables
# the user exported) still apply.
PER_RANK_FIELDS = (
    "coordinator", "job_id", "token", "size", "rank", "hostname", "data_plane_address",
)

_FIRST_NAME = {var.field: var.names[0] for var in ENV_VARS}


def worker_environment(
    base: Mapping[str, str],
    slot: SlotInfo,
    *,
    coordinator: str,
    job_id: str,
    token: str,
    worker_settings: Mapping[str, Any] | None = None,
    horovod_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Builds the environment of the worker for ``slot``.

    Args:
        base: the launcher's environment, inherited by the worker.
        slot: the rank's placement.
        coordinator: coordinator gRPC address ``HOST:PORT``.
        job_id: job the worker joins.
        token: job token.
        worker_settings: :class:`Settings` fields set by flags, by field name.
        horovod_env: Horovod variables for flags hora's settings do not model.

    Returns:
        ``base`` plus the hora and Horovod variables for this rank.

    Raises:
        hora.settings.SettingsError: a setting is out of range.
    """
    given = dict(worker_settings or {})
    settings = Settings(
        coordinator=coordinator,
        job_id=job_id,
        token=token,
        size=slot.size,
        rank=slot.rank,
        hostname=slot.hostname,
        data_plane_address=data_plane_address(slot.hostname),
        **given,
    )
    settings.validate()
    wanted = {_FIRST_NAME[name] for name in (*PER_RANK_FIELDS, *given)}

    env = dict(base)
    env.update(horovod_env or {})
    env.update({name: value for name, value in settings.to_env().items() if name in wanted})
    # Horovod's contract: scripts read these before (or instead of) hvd.init().
    env.update({
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_HOSTNAME": slot.hostname,
    })
    # Line-buffered output so the launcher can prefix lines as they come.
    env["PYTHONUNBUFFERED"] = "1"
    # N workers each with a thread per core oversubscribe small machines badly.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
