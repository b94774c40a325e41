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
from hora_proto.auth import JOB_TOKEN_PREFIX, job_token

from .hosts import SlotInfo, data_plane_address

__all__ = ["HOROVOD_PLACEMENT_VARS", "PER_RANK_FIELDS", "elastic_worker_environment",
           "worker_environment", "workers_token"]

# Settings fields every worker is given, whatever the flags; the others are
# passed only when a flag set them, so a worker's own defaults (or variables
# the user exported) still apply.
PER_RANK_FIELDS = (
    "coordinator", "job_id", "token", "size", "rank", "hostname", "data_plane_address",
)

# Horovod's placement variables. An elastic worker gets those of the slot it
# was started in (its start rank, as horovodrun gives them); they are not
# updated when later generations renumber the world.
HOROVOD_PLACEMENT_VARS = (
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
)

_FIRST_NAME = {var.field: var.names[0] for var in ENV_VARS}


def workers_token(token: str, job_id: str) -> str:
    """The token a worker of job ``job_id`` is given: the job token derived from
    the coordinator's admin ``token`` (it opens this job only), never the admin
    token itself; a job token given to the launcher is passed on as it is."""
    if not token or token.startswith(JOB_TOKEN_PREFIX):
        return token
    return job_token(token, job_id)


def _environment(base: Mapping[str, str], *, hostname: str, rank: int, size: int,
                 coordinator: str, job_id: str, token: str,
                 worker_settings: Mapping[str, Any] | None) -> dict[str, str]:
    given = dict(worker_settings or {})
    # A job across machines sets it for everyone ("auto"); else per host.
    given.setdefault("data_plane_address", data_plane_address(hostname))
    settings = Settings(
        coordinator=coordinator,
        job_id=job_id,
        token=workers_token(token, job_id),
        size=size,
        rank=rank,
        hostname=hostname,
        **given,
    )
    settings.validate()
    wanted = {_FIRST_NAME[name] for name in (*PER_RANK_FIELDS, *given)}

    env = dict(base)
    env.update({name: value for name, value in settings.to_env().items() if name in wanted})
    env["HOROVOD_HOSTNAME"] = hostname
    # Line-buffered output so the launcher can prefix lines as they come.
    env["PYTHONUNBUFFERED"] = "1"
    # N workers each with a thread per core oversubscribe small machines badly.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def worker_environment(
    base: Mapping[str, str],
    slot: SlotInfo,
    *,
    coordinator: str,
    job_id: str,
    token: str,
    worker_settings: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Builds the environment of the worker for ``slot``.

    Args:
        base: the launcher's environment, inherited by the worker.
        slot: the rank's placement.
        coordinator: coordinator gRPC address ``HOST:PORT``.
        job_id: job the worker joins.
        token: job token.
        worker_settings: :class:`Settings` fields set by flags, by field name.

    Returns:
        ``base`` plus the hora and Horovod variables for this rank.

    Raises:
        hora.settings.SettingsError: a setting is out of range.
    """
    env = _environment(base, hostname=slot.hostname, rank=slot.rank, size=slot.size,
                       coordinator=coordinator, job_id=job_id, token=token,
                       worker_settings=worker_settings)
    # Horovod's contract: scripts read these before (or instead of) hvd.init().
    env.update(_placement_vars(slot))
    return env


def _placement_vars(slot: SlotInfo) -> dict[str, str]:
    return {
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }


def elastic_worker_environment(
    base: Mapping[str, str],
    hostname: str,
    *,
    size: int,
    coordinator: str,
    job_id: str,
    token: str,
    worker_settings: Mapping[str, Any] | None = None,
    placement: SlotInfo | None = None,
) -> dict[str, str]:
    """Builds the environment of an elastic worker on ``hostname``.

    The coordinator assigns the ranks of every generation. With a
    ``placement`` (what ``horarun`` passes: the slot in the host assignment
    the worker starts in) the worker gets Horovod's placement variables for
    that slot, as horovodrun gives them, and ``HORA_RANK``/``HORA_SIZE``
    from it: the rank orders newcomers at the coordinator (a hint, never a
    promise), the size is the world the first generation waits for. Without
    one it gets ``HORA_RANK=-1``, ``HORA_SIZE=size`` and no placement
    variables (any the launcher inherited are removed, lest a script trust
    them). ``HOROVOD_HOSTNAME`` is set either way.

    Args:
        base: the launcher's environment, inherited by the worker.
        hostname: the host as discovery (or ``-H``) named it.
        size: the world size the job started with (``-np``).
        coordinator: coordinator gRPC address ``HOST:PORT``.
        job_id: job the worker joins.
        token: job token.
        worker_settings: :class:`Settings` fields set by flags, the elastic
            ones (``min_size``, ``max_size``, ``elastic_timeout``,
            ``reset_limit``) included.
        placement: the worker's slot in the host assignment it starts in.

    Raises:
        hora.settings.SettingsError: a setting is out of range.
    """
    rank, size = (-1, size) if placement is None else (placement.rank, placement.size)
    env = _environment(base, hostname=hostname, rank=rank, size=size,
                       coordinator=coordinator, job_id=job_id, token=token,
                       worker_settings=worker_settings)
    for name in HOROVOD_PLACEMENT_VARS:
        env.pop(name, None)
    if placement is not None:
        env.update(_placement_vars(placement))
    return env
