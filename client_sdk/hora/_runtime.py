"""Process-wide state behind ``hvd.init()``: the settings, the client, the engine.

Horovod's API is a set of module functions over one world per process, so
one :class:`Runtime` lives here; everything below it (client, engine,
backends) takes its dependencies as arguments.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import threading
from collections.abc import Iterator
from types import TracebackType

import torch.distributed as dist

from hora_proto.v1 import rendezvous_pb2

from ._client import CoordinatorClient
from ._solo import SoloClient
from ._store import CoordinatorStore
from .engine import Engine
from .errors import HoraError
from .settings import Settings, configure_logging

__all__ = ["Runtime", "current", "init", "is_initialized", "shutdown"]

log = logging.getLogger("hora")


class NotInitializedError(HoraError, ValueError):
    """A hora call was made before ``hvd.init()`` (or after ``hvd.shutdown()``)."""


class Runtime:
    """One joined world: its view, its engine, and the things it started."""

    def __init__(self, settings: Settings) -> None:
        self.client: CoordinatorClient | SoloClient
        store: dist.Store
        if settings.coordinator:
            self.client = CoordinatorClient(settings)
            store = CoordinatorStore(self.client, settings.start_timeout)
        else:
            settings = self._solo_settings(settings)
            self.client = SoloClient(settings)
            store = dist.HashStore()
        self.settings = settings
        try:
            self.client.wait_reachable()
            self.world: rendezvous_pb2.WorldView = self.client.join()
            self.engine = Engine(settings, self.client, self.world, store)
        except BaseException:
            self.client.close()
            raise
        self._names: dict[tuple[str, int], Iterator[int]] = {}
        # Ranks add process sets in the same order, so the same counter gives the same ids.
        self.next_process_set_id = 1

    @staticmethod
    def _solo_settings(settings: Settings) -> Settings:
        """A script started without horarun runs as a world of one, like Horovod's:
        no coordinator, its collectives answered in process (see :mod:`._solo`)."""
        if settings.size != 1:
            raise HoraError(
                f"HORA_SIZE={settings.size} but no coordinator address: start the workers "
                f"with horarun, or set HORA_COORDINATOR=HOST:PORT")
        return dataclasses.replace(settings, rank=0)

    def host_update_epoch(self) -> tuple[int, bool]:
        """The newest host change the coordinator announced, and whether it only removed."""
        return self.engine.host_update_epoch()

    def generation_host_epoch(self) -> int:
        """The host-change epoch the coordinator had when this generation formed."""
        return self.world.host_update_epoch

    def auto_name(self, op: str, process_set_id: int = 0) -> str:
        """Names an unnamed tensor the same way on every rank of its process set.

        Counted per operation and set: ranks outside a set skip its
        collectives, so one shared counter would drift apart between ranks.
        """
        key = (op, process_set_id)
        counter = self._names.get(key)
        if counter is None:
            counter = self._names.setdefault(key, itertools.count())
        scope = "" if process_set_id == 0 else f".set{process_set_id}"
        return f"{op}{scope}.noname.{next(counter)}"

    def close(self, rejoin: bool = False) -> None:
        try:
            self.engine.shutdown(rejoin=rejoin)
        finally:
            self.client.close()


_lock = threading.Lock()
_runtime: Runtime | None = None


def init(settings: Settings | None = None) -> Runtime:
    """Joins the job once per process; later calls return the same runtime."""
    global _runtime
    with _lock:
        if _runtime is None:
            settings = (settings or Settings.from_env()).with_reachable_address()
            configure_logging(settings)
            _runtime = Runtime(settings)
        return _runtime


def current() -> Runtime:
    """The runtime of this process.

    Raises:
        NotInitializedError: ``init()`` has not been called.
    """
    runtime = _runtime
    if runtime is None:
        raise NotInitializedError("hora has not been initialized; call hvd.init() first")
    return runtime


def is_initialized() -> bool:
    return _runtime is not None


def shutdown(rejoin: bool = False) -> None:
    """Leaves the job and releases everything ``init()`` built. Idempotent.

    Args:
        rejoin: leave only this generation (an elastic reset): the next
            ``init()`` joins the job's next generation as the same member.
    """
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.close(rejoin=rejoin)


def abandon() -> None:
    """The script is failing out of ``hvd.elastic.run``: if the exception is
    never caught, leave the job by dying.

    Should it reach the top level, the traceback is printed as always and
    the process then exits with code 1 at once, without a ``Leave`` and
    without the usual teardown: its peers, the coordinator and its launcher
    all learn of the failure in the same instant, when the process is gone.
    ``horarun`` then ends the failed host's other workers before the others
    re-form the world, as horovodrun's driver does before its next
    rendezvous; a graceful leave would let them re-form it while this
    process was still tearing down. A script that catches the exception
    keeps its runtime and exits as it likes.
    """
    previous = sys.excepthook
    if getattr(previous, "_hora_abandon", False):
        return

    def die(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)

    die._hora_abandon = True  # type: ignore[attr-defined]
    sys.excepthook = die


atexit.register(shutdown)
