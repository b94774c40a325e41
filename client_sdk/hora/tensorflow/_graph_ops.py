"""Collectives as asynchronous graph ops (``tf.function`` and ``tf.compat.v1`` graphs).

A blocking op per collective deadlocks a graph with several independent
collectives: each rank's inter-op pool starts a different subset of them,
and each rank waits for calls the other has not started. hora's graph op
(``HoraCollective``, ``hora_tf_ops.cc``) is asynchronous, like Horovod's
``AsyncOpKernel``s: it files a request and returns, so every collective of a
step is submitted whatever the pool size, and the engine negotiates which
ones are ready on every rank. The order ops start in no longer matters.

Two threads per process serve the requests:

- the dispatcher takes each request from the library (a blocking ctypes
  call; the GIL is released while it waits), copies its inputs and starts
  the engine's asynchronous collective; it never waits for one;
- the completer, woken by the engine handle's done callback, copies the
  results into the op's outputs (or sets its error status with TensorFlow's
  code for the error) and calls the op's ``done``.

Nobody waits on a graph op's engine handle (an eager call's ``synchronize``
polls the engine's failure while it waits; a graph op only has the done
callback), so the completer also watches the ops in flight: every
``_WATCH_S`` it fails, with the engine's error, each op whose engine has
failed or shut down while its handle is still not done. An engine can fail
without completing a handle: a tensor it had taken out of its pending table
for the data plane when the data plane broke (a peer killed mid-collective)
is never completed, and its op, and the ``tf.function`` or Keras step
waiting on it, would wait forever. A failed engine refuses new calls, so an
op submitted to it fails at once, in the dispatcher, with the same error.

A kernel here is ``start(*arrays) -> (handle, convert)``: it starts one
engine call on numpy inputs and returns its integer handle and a function
from the call's result to the output arrays. Without a C++ compiler the ops
fall back to a blocking ``tf.numpy_function``, with a warning.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import _runtime
from .. import world as _basics
from ..torch import mpi_ops as _engine_ops
from . import _build, _errors

__all__ = ["Kernel", "graph_op"]

log = logging.getLogger("hora")

Kernel = Callable[..., tuple[int, Callable[[Any], list[np.ndarray]]]]

_MAX_DIMS = 32
_calls: dict[int, tuple[Kernel, list[np.dtype]]] = {}
_call_ids = itertools.count(1)
_lock = threading.Lock()
# Ops started and not finished: request -> (handle id, its handle, the engine it went to).
# Whoever pops a request finishes its op: the completer, or the watch (_fail_abandoned).
_in_flight: dict[int, tuple[int, Any, Any]] = {}
_in_flight_lock = threading.Lock()
# How often the completer looks for ops whose engine failed under them.
_WATCH_S = 0.5
_library: Any = None  # (the op module, the ctypes library), or False: none could be built


def _load() -> Any:
    global _library
    with _lock:
        if _library is None:
            try:
                path = str(_build.library_path())
            except _build.BuildError as exc:
                warnings.warn(
                    f"hora could not build its TensorFlow graph op ({exc}); graph collectives "
                    f"fall back to blocking tf.numpy_function ops, which can deadlock a graph "
                    f"with several independent collectives", RuntimeWarning, stacklevel=4)
                _library = False
                return _library
            ops = tf.load_op_library(path)
            native = ctypes.CDLL(path)  # the same loaded object: dlopen shares it
            _declare(native)
            _library = (ops, native)
            completions: queue.SimpleQueue[Any] = queue.SimpleQueue()
            threads = [threading.Thread(target=target, args=(native, completions), daemon=True,
                                        name=f"hora-tf-{target.__name__.strip('_')}")
                       for target in (_dispatch, _complete)]
            for thread in threads:
                thread.start()
            atexit.register(_stop, threads, completions)
    return _library


_stopping = threading.Event()


def _stop(threads: list[threading.Thread], completions: queue.SimpleQueue[Any]) -> None:
    """Ends both threads before the interpreter finalizes: a daemon thread that comes back
    from the library into a finalizing interpreter can hang the process's exit."""
    _stopping.set()
    completions.put(None)
    for thread in threads:
        thread.join(timeout=5)


def _declare(native: Any) -> None:
    i64, c_int, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    native.hora_tf_next.argtypes, native.hora_tf_next.restype = [c_int], i64
    native.hora_tf_call_id.argtypes, native.hora_tf_call_id.restype = [i64], i64
    native.hora_tf_num_inputs.argtypes, native.hora_tf_num_inputs.restype = [i64], c_int
    native.hora_tf_input.argtypes = [i64, c_int, ctypes.POINTER(c_int), ctypes.POINTER(c_int),
                                     ctypes.POINTER(i64), c_int, ctypes.POINTER(ptr),
                                     ctypes.POINTER(i64)]
    native.hora_tf_input.restype = c_int
    native.hora_tf_output.argtypes = [i64, c_int, c_int, ctypes.POINTER(i64),
                                      ctypes.POINTER(i64)]
    native.hora_tf_output.restype = ptr
    native.hora_tf_finish.argtypes, native.hora_tf_finish.restype = [i64, c_int,
                                                                      ctypes.c_char_p], c_int


def graph_op(kernel: Kernel, inputs: Sequence[tf.Tensor], tout: Sequence[tf.DType],
             blocking: Callable[..., list[np.ndarray]]) -> list[tf.Tensor]:
    """The outputs of one graph op running ``kernel`` (``blocking`` without the library)."""
    library = _load()
    if library is False:
        made: Any = tf.numpy_function(blocking, list(inputs), list(tout), stateful=True)
        return list(made) if isinstance(made, (list, tuple)) else [made]
    ops, _ = library
    with _lock:
        call_id = next(_call_ids)
        _calls[call_id] = (kernel, [np.dtype(d.as_numpy_dtype) for d in tout])
    return list(ops.hora_collective(list(inputs), call_id=call_id, Tout=list(tout)))


# -- the two threads -----------------------------------------------------------------


def _read_inputs(native: Any, request: int) -> list[np.ndarray]:
    arrays = []
    dtype, ndims, data, nbytes = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p(), \
        ctypes.c_int64()
    dims = (ctypes.c_int64 * _MAX_DIMS)()
    for i in range(native.hora_tf_num_inputs(request)):
        if native.hora_tf_input(request, i, ctypes.byref(dtype), ctypes.byref(ndims), dims,
                                _MAX_DIMS, ctypes.byref(data), ctypes.byref(nbytes)) != 0:
            raise _errors.InvalidCallError(f"input {i} has more than {_MAX_DIMS} dimensions")
        kind = tf.dtypes.as_dtype(dtype.value)
        if kind == tf.string or kind == tf.resource or kind == tf.variant:
            raise _errors.InvalidCallError(f"collectives do not take {kind.name} tensors")
        # A copy: the engine may write in place, and TF's inputs are not ours to change.
        array = np.empty(tuple(dims[:ndims.value]), np.dtype(kind.as_numpy_dtype))
        if nbytes.value and data.value is not None:
            ctypes.memmove(array.ctypes.data, data.value, nbytes.value)
        arrays.append(array)
    return arrays


def _fail(native: Any, request: int, exc: BaseException) -> None:
    message = _errors.remember(request, exc)
    native.hora_tf_finish(request, _errors.status_code(exc), message.encode("utf-8", "replace"))


def _parts(handle: Any) -> list[Any] | None:
    """The engine handles a composite handle (a group, Adasum, sparse) is done with; None for
    an engine handle itself. Composites are done when their parts are, and never complete
    (nor call back) themselves."""
    if hasattr(handle, "handles"):
        return list(handle.handles)
    if hasattr(handle, "inner"):
        return [handle.inner]
    if hasattr(handle, "indices") and hasattr(handle, "values"):
        return [handle.indices, handle.values]
    return None


def _when_done(handle: Any, callback: Callable[[], None]) -> None:
    """Calls ``callback()`` once ``handle`` is done; a grouped call's once all its parts are."""
    parts = _parts(handle)
    if parts is None:
        handle.add_done_callback(lambda _handle: callback())
        return
    left = [len(parts)]
    lock = threading.Lock()

    def one_done(_handle: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback()

    if not parts:
        callback()
    for part in parts:
        part.add_done_callback(one_done)


def _claim(request: int) -> tuple[int, Any, Any] | None:
    """Takes ``request`` out of the ops in flight; None when another thread finished it."""
    with _in_flight_lock:
        return _in_flight.pop(request, None)


def _dispatch(native: Any, completions: queue.SimpleQueue[Any]) -> None:
    while not _stopping.is_set():
        request = native.hora_tf_next(200)
        if not request:
            continue
        registered = False
        try:
            kernel, dtypes = _calls[native.hora_tf_call_id(request)]
            # The engine the kernel submits to (NotInitializedError between generations:
            # the kernel's own submission would raise it too).
            engine = _runtime.current().engine
            handle_id, convert = kernel(*_read_inputs(native, request))
            handle = _basics._lookup(handle_id)
            with _in_flight_lock:
                _in_flight[request] = (handle_id, handle, engine)
            registered = True
            _when_done(handle, functools.partial(
                completions.put, (request, handle_id, (convert, dtypes))))
        except BaseException as exc:  # noqa: BLE001 - the op fails with it, the thread goes on
            if not registered or _claim(request) is not None:  # (else it is finished)
                _fail(native, request, exc)


def _write_outputs(native: Any, request: int, outputs: list[np.ndarray],
                   dtypes: list[np.dtype]) -> bool:
    nbytes = ctypes.c_int64()
    for i, (output, dtype) in enumerate(zip(outputs, dtypes, strict=True)):
        # (Not np.ascontiguousarray: it makes a scalar a 1-element vector.)
        array = np.asarray(output).astype(dtype, order="C", copy=False)
        dims = (ctypes.c_int64 * max(array.ndim, 1))(*array.shape)
        target = native.hora_tf_output(request, i, array.ndim, dims, ctypes.byref(nbytes))
        if not target:
            return False  # the op's status says why
        if nbytes.value != array.nbytes:
            raise _errors.InvalidCallError(f"output {i}: {array.nbytes} bytes for a "
                                           f"{nbytes.value}-byte tensor")
        if array.nbytes:
            ctypes.memmove(target, array.ctypes.data, array.nbytes)
    return True


def _complete(native: Any, completions: queue.SimpleQueue[Any]) -> None:
    watch_at = time.monotonic() + _WATCH_S
    while True:
        try:
            item = completions.get(timeout=max(0.0, watch_at - time.monotonic()))
        except queue.Empty:
            item = ()
        if item is None:
            return
        if item:
            _finish(native, *item)
        if time.monotonic() >= watch_at:  # (not per op: a step has hundreds in flight)
            _fail_abandoned(native)
            watch_at = time.monotonic() + _WATCH_S


def _finish(native: Any, request: int, handle_id: int, how: tuple[Any, list[np.dtype]]
            ) -> None:
    """Completes the op of a done handle (unless the watch failed it first)."""
    if _claim(request) is None:
        return
    convert, dtypes = how
    try:
        _write_outputs(native, request, convert(_engine_ops.synchronize(handle_id)), dtypes)
    except BaseException as exc:  # noqa: BLE001 - the op fails with it, the thread goes on
        _fail(native, request, exc)
    else:
        native.hora_tf_finish(request, 0, b"")


def _fail_abandoned(native: Any) -> None:
    """Fails, with its engine's error, every op whose engine failed or shut down while
    its handle is still not done: no stage of that engine will complete it any more."""
    with _in_flight_lock:
        abandoned = [(request, handle_id, engine.failure())
                     for request, (handle_id, handle, engine) in _in_flight.items()
                     if engine.failure() is not None and not handle.done()]
        for request, _handle_id, _failure in abandoned:
            del _in_flight[request]
    for request, handle_id, failure in abandoned:
        # (Its done callback, should it still come, finds the op finished.)
        _basics._handles.release(handle_id)
        _fail(native, request, failure)
