"""Elastic training, framework-neutral: state that survives a changing world.

The contract users know from Horovod:

- ``state.commit()`` saves a copy of the training state in memory (and
  checks for host changes); it is the point training resumes from.
- When a peer dies, collectives raise :class:`HorovodInternalError`: the
  wrapped function is left, the state is restored to the last commit, the
  worker re-joins the job (a new generation), the state is synchronised
  from rank 0, and the function is called again.
- When hosts are added or removed gracefully, ``commit()`` (through
  ``check_host_updates()``) raises :class:`HostsUpdatedInterrupt` on every
  rank at the same step: no restore is needed, only re-join and sync.
- A :class:`TensorMismatchError` (ranks disagree on a call) is raised out
  of the wrapped function unchanged: the world is intact and a retry would
  repeat the script's bug. Horovod resets on it; hora does not.

:func:`run_fn` builds the retry loop; the framework layers pass the
functions that re-join (``reset``) and broadcast objects.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

from .errors import HorovodInternalError, HostsUpdatedInterrupt, TensorMismatchError

__all__ = ["ObjectState", "State", "run_fn"]

log = logging.getLogger("hora.elastic")


class State:
    """Training state that can be committed, restored and synchronised.

    Args:
        bcast_object: broadcasts a picklable object from rank 0.
        get_rank: this worker's rank.
        host_update_epoch: the newest host-change epoch this worker has seen
            from the coordinator (0 when none), and whether only removals
            happened.
        agree_host_update: combines every rank's ``(epoch, removals_only)``
            into one answer, the same on every rank: the newest epoch, and
            removals only if every rank says so. A collective; the default
            broadcasts rank 0's with ``bcast_object``.
        generation_host_epoch: the job's host-change epoch when the current
            generation formed (its world view says; the same on every rank).
            Changes up to it are in the world already; a newer one is a
            newcomer waiting, even one that came before this worker's first
            heartbeat. Default: the newest epoch seen, as of the sync.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 host_update_epoch: Callable[[], tuple[int, bool]] | None = None,
                 agree_host_update: Callable[[tuple[int, bool]], tuple[int, bool]] | None = None,
                 generation_host_epoch: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_update_epoch = host_update_epoch or (lambda: (0, False))
        self._agree_host_update = agree_host_update or bcast_object
        self._generation_host_epoch = (generation_host_epoch
                                       or (lambda: self._host_update_epoch()[0]))
        self._last_host_epoch = 0
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called after every reset (for example to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state in memory, then checks whether hosts changed.

        Raises:
            HostsUpdatedInterrupt: hosts were added or removed (on every rank
                at once): the caller's retry loop re-joins and syncs.
        """
        self.save()
        self.check_host_updates()

    def sync_host_updates(self) -> None:
        """Adopts the epoch the current generation formed at, so that changes it took in
        do not interrupt again (a worker that just joined starts from there), while a
        newcomer that joined after the forming interrupts at the next commit."""
        epoch, _ = self._agree_host_update((self._generation_host_epoch(), False))
        self._last_host_epoch = epoch

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank when a rank has seen a host change."""
        # One answer for all, so that every rank interrupts at the same step.
        epoch, removals_only = self._agree_host_update(self._host_update_epoch())
        if epoch > self._last_host_epoch:
            self._last_host_epoch = epoch
            raise HostsUpdatedInterrupt(skip_sync=removals_only)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a re-join, before the reset callbacks."""


class ObjectState(State):
    """State made of plain picklable attributes, e.g. ``ObjectState(epoch=0, batch=0)``."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 host_update_epoch: Callable[[], tuple[int, bool]] | None = None,
                 agree_host_update: Callable[[tuple[int, bool]], tuple[int, bool]] | None = None,
                 generation_host_epoch: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank, host_update_epoch, agree_host_update,
                         generation_host_epoch)

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        # A copy: training may mutate a list or dict attribute after the commit.
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()


def run_fn(func: Callable[..., Any], reset: Callable[[], None],
           reset_limit: Callable[[], int | None] = lambda: None,
           on_failure: Callable[[], None] = lambda: None,
           job_resets: Callable[[], int] | None = None) -> Callable[..., Any]:
    """Wraps ``func(state, ...)`` in the elastic retry loop.

    Args:
        func: the training function; its first argument is the State.
        reset: leaves the old world and joins the next one.
        reset_limit: returns how many resets are allowed before giving up (None: no
            limit); asked when a reset is due, from the joined world's settings.
        on_failure: called when an exception other than a reset leaves
            ``func``, before it propagates (the worker is failing).
        job_resets: the job's resets so far, as the world just joined says
            (None: count this worker's own). As in Horovod, the limit is the
            job's: checked after re-joining, so that every member of a
            generation beyond it stops before training in it.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        resets = 0
        while True:
            try:
                if not skip_sync:
                    state.sync()
                state.sync_host_updates()
                return func(state, *args, **kwargs)
            except TensorMismatchError:
                # Ranks that disagree are a bug in the script, and the world is
                # intact: a retry would only repeat it.
                on_failure()
                raise
            except HorovodInternalError as exc:
                log.warning("collective failed (%s); restoring the last commit", exc)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                log.info("hosts changed; re-joining without a restore")
                skip_sync = exc.skip_sync
            except Exception:
                on_failure()
                raise
            resets += 1
            limit = reset_limit()
            if limit is not None and job_resets is None and resets > limit:
                raise HorovodInternalError(
                    f"gave up after {limit} reset(s) (HORA_RESET_LIMIT / --reset-limit)")
            reset()
            if limit is not None and job_resets is not None and job_resets() > limit:
                raise HorovodInternalError(
                    f"reset limit {limit} exceeded: the job has been reset {job_resets()} "
                    f"times (HORA_RESET_LIMIT / --reset-limit)")
            state.on_reset()

    return wrapper
