"""The processes of a Ray job: the coordinator actor and the worker actors.

Plain classes; :mod:`.executor` turns them into Ray actors with the
resources each one asks for. Both are imported by Ray on the node that
runs them, so they import nothing the node may lack at module level.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from typing import Any

from hora._clusters import enter_shim, loads

__all__ = ["CoordinatorActor", "WorkerActor", "WorkerFailure"]


def node_ip() -> str:
    """This node's IP address as Ray knows it (the address the other nodes reach)."""
    import ray

    return str(ray.util.get_node_ip_address())


class WorkerFailure(Exception):
    """The user's function raised on a worker: its type, message and traceback as text.

    Carried back to the driver instead of the exception itself, which may not
    unpickle there.
    """

    def __init__(self, kind: str, message: str, trace: str) -> None:
        super().__init__(kind, message, trace)
        self.kind = kind
        self.message = message
        self.trace = trace

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}\n{self.trace}"


class CoordinatorActor:
    """A hora coordinator serving on this node's IP address, for one job."""

    def __init__(self, token: str) -> None:
        from hora.runner.embedded import start_embedded_coordinator

        self._coordinator = start_embedded_coordinator(node_ip(), token)

    def address(self) -> tuple[str, int]:
        """The gRPC address ``HOST:PORT`` and the HTTP (dashboard) port."""
        return self._coordinator.grpc_address, self._coordinator.http_port

    def stop(self) -> None:
        self._coordinator.stop()


class WorkerActor:
    """One rank: runs the user's functions in a process Ray placed.

    Args:
        shim: the ``horovod`` shim's folder when the driver uses it, else None.
    """

    def __init__(self, shim: str | None) -> None:
        enter_shim(shim)
        self.executable: Any = None

    def where(self) -> tuple[str, int]:
        """This actor's node IP and pid."""
        return node_ip(), os.getpid()

    def set_env(self, env: Mapping[str, str]) -> None:
        """The job's variables, read by ``hvd.init()`` (and by scripts, as under Horovod)."""
        os.environ.update(env)

    def start_executable(self, payload: bytes | None) -> None:
        """Builds Horovod's ``executable_cls(*args, **kwargs)`` that ``execute`` hands to fns."""
        if payload is None:
            return
        cls, args, kwargs = loads(payload)
        self.executable = cls(*args, **kwargs)

    def leave(self) -> None:
        """Leaves the hora job, if a function joined it (``hvd.shutdown()``)."""
        from hora import _runtime

        _runtime.shutdown()

    def execute_elastic(self, payload: bytes) -> tuple[int, Any]:
        """Calls the pickled ``fn()`` of an elastic job; this rank at the end, and its result.

        Raises:
            WorkerFailure: it raised.
        """
        from hora import _runtime

        value = self.execute(payload, False)
        rank = _runtime.current().world.rank if _runtime.is_initialized() else -1
        return rank, value

    def execute(self, payload: bytes, with_executable: bool) -> Any:
        """Calls the pickled function: ``fn(executable)`` or ``fn(*args, **kwargs)``.

        Raises:
            WorkerFailure: it raised; the traceback travels as text.
        """
        fn, args, kwargs = loads(payload)
        try:
            if with_executable:
                return fn(self.executable)
            return fn(*args, **kwargs)
        except Exception as exc:
            raise WorkerFailure(type(exc).__name__, str(exc), traceback.format_exc()) from None
