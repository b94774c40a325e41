"""Process sets: AddProcessSet and RemoveProcessSet, collectives of every member.

:func:`call_add_process_set` and :func:`call_remove_process_set` check the
caller (an ACTIVE member of the running generation) and hand its call to the
table, which gathers every rank's call and decides once
(:mod:`hora_negotiation.set_calls`). The decision becomes one
:class:`~.effects.Answer` to every caller: the coordinator resolves their
waiting calls with it. A call that can never complete ends the same way:
:func:`abandon_set_calls` when a member departs or the generation ends,
:func:`overdue_set_calls` when the calls waited longer than the job's stall
shutdown time, :func:`withdraw_set_call` when a caller gives up.

:func:`add_process_set` and :func:`remove_process_set` are the table's rules
for one caller, applied at once (registration is idempotent, and a removed id
stays removed in its generation); the collective calls apply the same rules
once every rank has called.
"""

from __future__ import annotations

import logging

from hora_negotiation import SetCall, SetCallKind, SetCallResult, format_ranks

from ..messages import AddProcessSetRequest, RemoveProcessSetRequest
from .effects import Answer, Effect, Log, send_by_rank
from .job import Job, JobPhase
from .streams import active_member

__all__ = [
    "abandon_set_calls",
    "add_process_set",
    "call_add_process_set",
    "call_remove_process_set",
    "overdue_set_calls",
    "remove_process_set",
    "withdraw_set_call",
]


def call_add_process_set(job: Job, request: AddProcessSetRequest, now: float) -> list[Effect]:
    """One rank's AddProcessSet: gathered; once every rank called, one Answer for all.

    Raises:
        JobFailedError, StaleGenerationError, PreconditionError: the caller is
            not an ACTIVE member of the running generation ``request.generation``.
    """
    member = active_member(job, request.worker_id, request.generation)
    call = SetCall(
        SetCallKind.ADD, member.rank, request.process_set_id, tuple(request.ranks), request.invalid
    )
    return _answered(job, job.table.call_process_set(call, now))


def call_remove_process_set(job: Job, request: RemoveProcessSetRequest, now: float) -> list[Effect]:
    """One rank's RemoveProcessSet: gathered; once every rank called, one Answer for all.

    Raises:
        JobFailedError, StaleGenerationError, PreconditionError: the caller is
            not an ACTIVE member of the running generation ``request.generation``.
    """
    member = active_member(job, request.worker_id, request.generation)
    call = SetCall(SetCallKind.REMOVE, member.rank, request.process_set_id, invalid=request.invalid)
    return _answered(job, job.table.call_process_set(call, now))


def withdraw_set_call(job: Job, worker_id: str, generation: int, kind: SetCallKind) -> list[Effect]:
    """The caller of a waiting call gave up (its deadline): the call no longer counts."""
    member = job.by_worker.get(worker_id)
    if member is not None and generation == job.generation and job.phase is JobPhase.RUNNING:
        job.table.set_calls.withdraw(kind, member.rank)
    return []


def abandon_set_calls(job: Job, reason: str) -> list[Effect]:
    """Every waiting call fails: ``reason`` (a departure, the generation's end) says why."""
    effects: list[Effect] = []
    for result in job.table.set_calls.abandon(reason):
        effects.extend(_answered(job, result))
    return effects


def overdue_set_calls(job: Job, now: float) -> list[Effect]:
    """Waiting calls older than the job's stall shutdown time fail (none when it is 0)."""
    config = job.config
    if config is None or config.stall_shutdown_s <= 0:
        return []
    effects: list[Effect] = []
    for result in job.table.set_calls.overdue(now, config.stall_shutdown_s):
        effects.extend(_answered(job, result))
    return effects


def _answered(job: Job, result: SetCallResult | None) -> list[Effect]:
    """The effects of a decided call: its Answer, a log line, a removal's failed tensors."""
    if result is None:
        return []
    callers = tuple(job.members[rank].worker_id for rank in result.callers)
    where = f"job '{job.job_id}' generation {job.generation}"
    effects: list[Effect] = [Answer(callers, result.kind, result.error)]
    if result.error is not None:
        effects.append(Log(logging.WARNING, f"{where}: {result.error}"))
    elif result.changed and result.kind is SetCallKind.ADD:
        effects.append(_added(job, result.process_set_id, result.ranks))
    elif result.changed:
        effects.append(_removed(job, result.process_set_id))
        effects.extend(send_by_rank(job, dict(result.failed)))
    return effects


def _added(job: Job, process_set_id: int, ranks: tuple[int, ...] | list[int]) -> Log:
    return Log(
        logging.INFO,
        f"job '{job.job_id}' generation {job.generation}: process set {process_set_id} "
        f"added with ranks {format_ranks(ranks)}",
    )


def _removed(job: Job, process_set_id: int) -> Log:
    return Log(
        logging.INFO,
        f"job '{job.job_id}' generation {job.generation}: process set {process_set_id} removed",
    )


def add_process_set(
    job: Job, worker_id: str, generation: int, process_set_id: int, ranks: list[int]
) -> list[Effect]:
    """Registers a process set of the caller's generation at once (idempotent).

    The table's rule under the collective :func:`call_add_process_set`: a
    repeated call with the same ranks confirms the set and changes nothing.

    Raises:
        InvalidRequestError: id 0, bad ranks, or the id is taken by other ranks.
        JobFailedError, StaleGenerationError, PreconditionError: the caller is
            not an ACTIVE member of the running generation ``generation``.
    """
    active_member(job, worker_id, generation)
    if not job.table.add_process_set(process_set_id, ranks):
        return []
    return [_added(job, process_set_id, ranks)]


def remove_process_set(
    job: Job, worker_id: str, generation: int, process_set_id: int
) -> list[Effect]:
    """Removes a process set at once (idempotent); its pending tensors fail on their submitters.

    The table's rule under the collective :func:`call_remove_process_set`.

    Raises:
        InvalidRequestError: ``process_set_id`` is 0.
        JobFailedError, StaleGenerationError, PreconditionError: the caller is
            not an ACTIVE member of the running generation ``generation``.
    """
    active_member(job, worker_id, generation)
    if process_set_id not in job.table.process_sets and process_set_id != 0:
        return []
    failed = job.table.remove_process_set(process_set_id)
    effects: list[Effect] = [_removed(job, process_set_id)]
    effects.extend(send_by_rank(job, failed))
    return effects
