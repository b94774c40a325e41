"""Process set calls (AddProcessSet, RemoveProcessSet): collectives the coordinator
answers once every rank has called (a part of :class:`~.coordinator.Coordinator`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TypeVar

from hora_negotiation import SetCallKind

from . import state
from .limits import shown_id
from .messages import AddProcessSetRequest, RemoveProcessSetRequest
from .runtime import JobRuntime, new_waiter

__all__ = ["ProcessSetCalls"]

_E = TypeVar("_E", bound=Exception)


class ProcessSetCalls:
    """Waiting process set calls, and their answers (mixed into the coordinator)."""

    clock: Callable[[], float]
    runtimes: dict[str, JobRuntime]
    apply: Callable[[state.Job, Iterable[state.Effect]], None]
    job: Callable[[str], state.Job]

    async def add_process_set(self, request: AddProcessSetRequest) -> None:
        """One rank's AddProcessSet: waits until every rank has called; then every call
        returns (the set is registered) or raises the same error.

        Raises:
            InvalidRequestError: some rank's call was invalid, the calls differ, or
                the set is refused.
            CallTimeoutError: some ranks did not call within the stall shutdown time.
            PreconditionError: the caller is not an active member, or the call can
                never complete (RankGoneError: a member departed).
        """
        job = self.job(request.job_id)
        await self._set_call(
            job,
            request.worker_id,
            request.generation,
            SetCallKind.ADD,
            lambda: state.call_add_process_set(job, request, self.clock()),
        )

    async def remove_process_set(self, request: RemoveProcessSetRequest) -> None:
        """One rank's RemoveProcessSet, a collective like :meth:`add_process_set`."""
        job = self.job(request.job_id)
        await self._set_call(
            job,
            request.worker_id,
            request.generation,
            SetCallKind.REMOVE,
            lambda: state.call_remove_process_set(job, request, self.clock()),
        )

    async def _set_call(
        self,
        job: state.Job,
        worker_id: str,
        generation: int,
        kind: SetCallKind,
        transition: Callable[[], Iterable[state.Effect]],
    ) -> None:
        """Applies a process set call's transition, then waits for the Answer to it.

        A newer call of the same worker and kind replaces this one (which then
        raises SupersededError); cancelling the call (the caller's deadline)
        withdraws it.
        """
        set_calls = self.runtimes[job.job_id].set_calls
        key = (worker_id, kind)
        waiter = new_waiter(set_calls, key, f"a newer {kind.value} call from worker "
                            f"{worker_id} in job '{shown_id(job.job_id)}' replaced this one")
        try:
            self.apply(job, transition())
        except BaseException:
            if set_calls.get(key) is waiter:
                del set_calls[key]
            raise
        try:
            await waiter
        except asyncio.CancelledError:
            if set_calls.get(key) is waiter:
                del set_calls[key]
                self.apply(job, state.withdraw_set_call(job, worker_id, generation, kind))
            raise

    def _answer(self, job_id: str, answer: state.Answer) -> None:
        runtime = self.runtimes.get(job_id)
        if runtime is None:
            return
        for worker_id in answer.worker_ids:
            waiter = runtime.set_calls.pop((worker_id, answer.kind), None)
            if waiter is None or waiter.done():
                continue
            if answer.error is None:
                waiter.set_result(None)
            else:  # one exception object per waiter: each call raises (and tracebacks) its own
                waiter.set_exception(_copy(answer.error))


def _copy(error: _E) -> _E:
    """A fresh exception of the same type and message."""
    return type(error)(*error.args)
