"""Collectives on TensorFlow tensors: Horovod's ``horovod.tensorflow`` signatures.

Each collective is one call of :mod:`hora.torch`'s (the same negotiation,
fusion, response cache, timeline and errors), with the tensors converted at
the edge (:mod:`._convert`). In eager mode the call runs at once; in a graph
(``tf.function`` or a ``tf.compat.v1`` Session) it becomes one asynchronous
op (:mod:`._graph_ops`): the order a graph's collectives start in does not
matter, the engine negotiates which are ready on every rank, as Horovod's
``AsyncOpKernel``s do. Unnamed collectives take the name of their input
tensor in a graph (the same on every rank, also when ranks trace a function
a different number of times) and the engine's automatic name in eager mode.

Errors are TensorFlow's classes (:mod:`._errors`): ranks that disagree on a
call raise ``tf.errors.FailedPreconditionError``, an invalid call
``tf.errors.InvalidArgumentError`` (eager: classes with hora's bases too),
an unregistered process set ``ValueError`` when a graph op is built.

Gradients are Horovod's (``horovod/tensorflow/mpi_ops.py``):

- allreduce: the same allreduce (op, scale factors) of the gradient;
- allgather: the average of the gradients, of which each rank keeps its rows;
- broadcast: the average of the gradients at the root, zeros elsewhere;
- alltoall: the gradients go back to the ranks their rows came from;
- reducescatter: the allgather of the gradients (times the set's size for Sum).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import _runtime
from .. import world as _basics
from ..errors import HoraError
from ..torch import mpi_ops as _engine_ops
from ..torch.mpi_ops import ReduceOp, start_timeline, stop_timeline
from ..world import *  # noqa: F403 - the world, process sets and builds are shared
from ..world import Average, ProcessSet, Sum, global_process_set, rank, size
from . import _errors, _graph_ops
from ._convert import to_numpy, to_torch
from ._errors import engine_error  # noqa: F401 - elastic.py and scripts find it here

# The torch layer's integer handles (poll, synchronize) stay there: TF's calls return tensors.
_WORLD = [n for n in _basics.__all__ if n not in ("poll", "synchronize")]
__all__ = [
    *_WORLD, "ReduceOp", "allgather", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "join",
    "local_rank_op", "local_size_op", "process_set_included_op", "rank_op", "reducescatter",
    "size_op", "start_timeline", "stop_timeline",
]

_sync = _engine_ops.synchronize


# -- running a collective in eager mode or in a graph --------------------------------


def _graph_name(name: str | None, op: str, tensors: Sequence[Any],
                process_set: ProcessSet) -> str | None:
    """The name of an unnamed collective in a graph: from its tensors' names, as Horovod's.

    Raises:
        ValueError: in a graph, the process set is not registered (as Horovod, when the
            op is built).
    """
    if tf.executing_eagerly():
        return name
    _basics.check_process_set(process_set)
    if name is not None:
        return name
    base = "..".join(dict.fromkeys(re.sub(r"[^\w./-]", "_", t.name) for t in (
        tensors[0], tensors[-1])))
    scope = "" if not process_set.process_set_id else f".set{process_set.process_set_id}"
    return f"tf.{op}{scope}.{base}"


def _run(kernel: _graph_ops.Kernel, inputs: Sequence[Any], tout: Sequence[tf.DType],
         shapes: Sequence[Any]) -> list[tf.Tensor]:
    """Runs ``kernel`` on the inputs' values: now (eager), or as an asynchronous graph op."""
    if tf.executing_eagerly():
        try:
            handle, convert = kernel(*[np.asarray(t) for t in inputs])
            arrays = convert(_sync(handle))
        except HoraError as exc:
            translated = _errors.translate(exc)
            if translated is exc:
                raise
            raise translated from exc
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(arrays, tout, strict=True)]

    def blocking(*arrays: np.ndarray) -> list[np.ndarray]:
        handle, convert = kernel(*arrays)
        return convert(_sync(handle))

    outputs = _graph_ops.graph_op(kernel, inputs, tout, blocking)
    for output, shape in zip(outputs, shapes, strict=True):
        output.set_shape(shape)
    return outputs


def _rows_unknown(shape: tf.TensorShape) -> tf.TensorShape:
    if shape.rank is None:
        return tf.TensorShape(None)
    if shape.rank == 0:
        return tf.TensorShape([None])
    return tf.TensorShape([None]).concatenate(shape[1:])


def _connected(grads: Sequence[Any], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Zeros for the outputs a loss did not use: every rank must send every tensor."""
    return [tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
            for g, x in zip(grads, like, strict=True)]


def _tensor(value: Any) -> Any:
    if isinstance(value, tf.IndexedSlices):
        return value
    return tf.convert_to_tensor(value)


# -- the kernels: numpy in, the engine's call started, numpy out ---------------------


def _outputs(result: Any) -> list[np.ndarray]:
    return [to_numpy(t) for t in (result if isinstance(result, list) else [result])]


def _allreduce_kernel(name: str | None, op: Any, pre: float, post: float,
                      process_set: ProcessSet, grouped: bool) -> _graph_ops.Kernel:
    def kernel(*arrays: np.ndarray) -> tuple[int, Any]:
        # Copies: the engine reduces in place, and an eager tensor's numpy() may be its buffer.
        tensors = [to_torch(a, copy=True) for a in arrays]
        if not grouped:
            return _engine_ops.allreduce_async_(
                tensors[0], name=name, op=op, prescale_factor=pre, postscale_factor=post,
                process_set=process_set), _outputs
        return _engine_ops.grouped_allreduce_async_(
            tensors, name=name, op=op, prescale_factor=pre, postscale_factor=post,
            process_set=process_set), _outputs
    return kernel


def _allgather_kernel(name: str | None, process_set: ProcessSet) -> _graph_ops.Kernel:
    def kernel(*arrays: np.ndarray) -> tuple[int, Any]:
        tensors = [to_torch(a) for a in arrays]
        if len(tensors) == 1:
            return _engine_ops.allgather_async(tensors[0], name=name,
                                               process_set=process_set), _outputs
        return _engine_ops.grouped_allgather_async(tensors, name=name,
                                                   process_set=process_set), _outputs
    return kernel


def _reducescatter_kernel(name: str | None, op: Any, pre: float, post: float,
                          process_set: ProcessSet, single: bool) -> _graph_ops.Kernel:
    def kernel(*arrays: np.ndarray) -> tuple[int, Any]:
        tensors = [to_torch(a) for a in arrays]
        if single:
            return _engine_ops.reducescatter_async(
                tensors[0], name=name, op=op, process_set=process_set, prescale_factor=pre,
                postscale_factor=post), _outputs
        return _engine_ops.grouped_reducescatter_async(
            tensors, name=name, op=op, process_set=process_set, prescale_factor=pre,
            postscale_factor=post), _outputs
    return kernel


# -- allreduce -----------------------------------------------------------------------


def _resolve_op(op: Any, average: bool | None) -> Any:
    if op is None and average is not None:
        return Average if average else Sum
    return Average if op is None else op


def _allreduce_dense(tensor: tf.Tensor, name: str | None, op: Any, pre: float, post: float,
                     process_set: ProcessSet) -> tf.Tensor:
    @tf.custom_gradient
    def forward(x: tf.Tensor) -> Any:
        out_name = _graph_name(name, "allreduce", [x], process_set)
        (y,) = _run(_allreduce_kernel(out_name, op, pre, post, process_set, False), [x], [x.dtype],
                    [x.shape])

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return _allreduce_dense(tf.convert_to_tensor(dy), None, op, pre, post, process_set)
        return y, grad

    return forward(tensor)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = None, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduces ``tensor`` over the ranks of the process set (default: average).

    ``tf.IndexedSlices`` (sparse gradients) are allgathered, values and
    indices, and averaged for ``op=Average``, as in Horovod.
    """
    del device_dense, device_sparse, ignore_name_scope
    op = _resolve_op(op, average)
    tensor = _tensor(tensor)
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (Average, Sum):
            raise NotImplementedError("sparse allreduce supports op Average and Sum only")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("prescale_factor and postscale_factor are not supported "
                                      "for tf.IndexedSlices (sparse) allreduce")
        values = allgather(tensor.values, name=None if name is None else f"{name}.values",
                           process_set=process_set)
        indices = allgather(tensor.indices, name=None if name is None else f"{name}.indices",
                            process_set=process_set)
        if op == Average:
            values = values / tf.cast(process_set.size(), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    if compression is None:
        return _allreduce_dense(tensor, name, op, prescale_factor, postscale_factor,
                                process_set)
    wire, ctx = compression.compress(tensor)
    reduced = _allreduce_dense(wire, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def _grouped_allreduce_dense(tensors: list[tf.Tensor], name: str | None, op: Any, pre: float,
                             post: float, process_set: ProcessSet) -> list[tf.Tensor]:
    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        group_name = _graph_name(name, "grouped_allreduce", xs, process_set)
        ys = _run(_allreduce_kernel(group_name, op, pre, post, process_set, True), xs,
                  [x.dtype for x in xs], [x.shape for x in xs])

        def grad(*dys: Any) -> list[tf.Tensor]:
            return _grouped_allreduce_dense(_connected(dys, xs), None, op, pre, post,
                                            process_set)
        return ys, grad

    return list(forward(*tensors))


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "", compression: Any = None,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: str | None = None,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False) -> list[Any]:
    """Reduces several tensors as one group: one negotiation, fused on the wire."""
    del device_dense, device_sparse, ignore_name_scope
    op = _resolve_op(op, average)
    tensors = [_tensor(t) for t in tensors]
    if not tensors:
        return []
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, op=op, compression=compression, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)
                for t in tensors]
    if compression is None:
        return _grouped_allreduce_dense(tensors, name, op, prescale_factor, postscale_factor,
                                        process_set)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _grouped_allreduce_dense([w for w, _ in pairs], name, op, prescale_factor,
                                       postscale_factor, process_set)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs, strict=True)]


# -- allgather -----------------------------------------------------------------------


def _own_rows(grad: tf.Tensor, x: tf.Tensor, process_set: ProcessSet) -> tf.Tensor:
    """This rank's rows of an allgathered gradient (ranks may have sent different counts)."""
    rows = tf.reshape(tf.shape(x, out_type=tf.int64)[0] if x.shape.rank else
                      tf.constant(1, tf.int64), [1])
    counts = allgather(rows, process_set=process_set)
    me = process_set.rank()
    start = tf.reduce_sum(counts[:me])
    part = grad[start:start + counts[me]]
    return part if x.shape.rank else tf.reshape(part, [])


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenates every rank's ``tensor`` along the first dimension (sizes may differ)."""
    del ignore_name_scope

    @tf.custom_gradient
    def forward(x: tf.Tensor) -> Any:
        gather_name = _graph_name(name, "allgather", [x], process_set)
        (y,) = _run(_allgather_kernel(gather_name, process_set), [x], [x.dtype],
                    [_rows_unknown(x.shape)])

        def grad(dy: tf.Tensor) -> tf.Tensor:
            reduced = allreduce(dy, op=Average, process_set=process_set)
            return _own_rows(reduced, x, process_set)
        return y, grad

    return forward(_tensor(tensor))


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgathers several tensors as one call."""
    del ignore_name_scope
    tensors = [_tensor(t) for t in tensors]

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        gather_name = _graph_name(name, "grouped_allgather", xs, process_set)
        ys = _run(_allgather_kernel(gather_name, process_set), xs, [x.dtype for x in xs],
                  [_rows_unknown(x.shape) for x in xs])

        def grad(*dys: Any) -> list[tf.Tensor]:
            return [_own_rows(allreduce(d, op=Average, process_set=process_set), x, process_set)
                    for d, x in zip(_connected(dys, ys), xs, strict=True)]
        return ys, grad

    return list(forward(*tensors))


# -- broadcast -----------------------------------------------------------------------


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """The root rank's ``tensor``, on every rank of the process set."""
    del ignore_name_scope

    @tf.custom_gradient
    def forward(x: tf.Tensor) -> Any:
        cast_name = _graph_name(name, "broadcast", [x], process_set)

        def kernel(array: np.ndarray) -> tuple[int, Any]:
            return _engine_ops.broadcast_async_(to_torch(array, copy=True), root_rank,
                                                name=cast_name, process_set=process_set), _outputs

        (y,) = _run(kernel, [x], [x.dtype], [x.shape])

        def grad(dy: tf.Tensor) -> tf.Tensor:
            reduced = allreduce(dy, op=Average, process_set=process_set)
            return reduced if rank() == root_rank else reduced * 0
        return y, grad

    return forward(_tensor(tensor))


def broadcast_(variables: Sequence[tf.Variable], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Overwrites ``variables`` with the root rank's values, in place; returns the values."""
    base = name or "broadcast_"
    return [v.assign(broadcast(v, root_rank, name=f"{base}.{i}", process_set=process_set))
            for i, v in enumerate(variables)]


# -- alltoall ------------------------------------------------------------------------


def _alltoall_outputs(result: Any) -> list[np.ndarray]:
    out, received = result
    return [to_numpy(out), np.asarray(received, dtype=np.int32).reshape(-1)]


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Sends ``splits[r]`` rows of ``tensor`` to rank r and gathers what the others send.

    Returns:
        The gathered tensor; with ``splits`` given, also the int32 counts of
        rows received from each rank.
    """
    del ignore_name_scope
    tensor = _tensor(tensor)
    split_tensor = (tf.constant([], tf.int32) if splits is None
                    else tf.cast(tf.convert_to_tensor(splits), tf.int32))

    @tf.custom_gradient
    def forward(x: tf.Tensor, s: tf.Tensor) -> Any:
        call_name = _graph_name(name, "alltoall", [x], process_set)

        def kernel(array: np.ndarray, split_array: np.ndarray) -> tuple[int, Any]:
            given = None if splits is None else [int(v) for v in split_array]
            return _engine_ops.alltoall_async(to_torch(array), given, name=call_name,
                                              process_set=process_set), _alltoall_outputs

        y, received = _run(kernel, [x, s], [x.dtype, tf.int32],
                           [_rows_unknown(x.shape), tf.TensorShape([process_set.size()])])

        def grad(dy: tf.Tensor, _unused: Any = None) -> tuple[Any, None]:
            back, _ = alltoall(dy, received, process_set=process_set)
            return back, None
        return (y, received), grad

    output, received = forward(tensor, split_tensor)
    return output if splits is None else (output, received)


# -- reducescatter -------------------------------------------------------------------


def _reducescatter(tensors: list[tf.Tensor], name: str | None, op: Any, pre: float,
                   post: float, process_set: ProcessSet, single: bool) -> list[tf.Tensor]:
    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        call_name = _graph_name(name, "reducescatter" if single else "grouped_reducescatter",
                                xs, process_set)
        ys = _run(_reducescatter_kernel(call_name, op, pre, post, process_set, single), xs,
                  [x.dtype for x in xs], [_rows_unknown(x.shape) for x in xs])

        def grad(*dys: Any) -> list[tf.Tensor]:
            scale = pre * post * (process_set.size() if op == Sum else 1)
            gathered = [allgather(d, process_set=process_set) for d in _connected(dys, ys)]
            return [g * tf.cast(scale, g.dtype) if scale != 1 else g for g in gathered]
        return ys, grad

    return list(forward(*tensors))


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = None,
                  op: Any = Average, name: str | None = None,
                  process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduces ``tensor`` over the ranks and returns this rank's share of its rows.

    Rank r receives ``n // size`` rows, plus one for the first ``n % size`` ranks.
    """
    return grouped_reducescatter([tensor], device_dense, compression, op, name, process_set,
                                 ignore_name_scope, prescale_factor, postscale_factor,
                                 _single=True)[0]


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = None, op: Any = Average, name: str | None = None,
                          process_set: ProcessSet = global_process_set,
                          ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, _single: bool = False
                          ) -> list[tf.Tensor]:
    """Reducescatters several tensors as one call."""
    del device_dense, ignore_name_scope
    values = [_tensor(t) for t in tensors]
    if compression is None:
        return _reducescatter(values, name, op, prescale_factor, postscale_factor, process_set,
                              _single)
    pairs = [compression.compress(t) for t in values]
    out = _reducescatter([w for w, _ in pairs], name, op, prescale_factor, postscale_factor,
                         process_set, _single)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(out, pairs, strict=True)]


# -- join, barrier, the world as ops -------------------------------------------------


def join() -> tf.Tensor:
    """Declares that this rank has no more data; returns the last rank to join."""
    return tf.constant(_engine_ops.join(), dtype=tf.int32)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the process set has reached it."""
    _engine_ops.barrier(process_set=process_set)


def _set_ranks(process_set_id: int) -> tuple[int, ...]:
    """The ranks of a registered process set (ValueError when there is none with that id)."""
    if process_set_id == 0:
        return tuple(range(size()))
    return tuple(_runtime.current().engine.process_set(process_set_id).ranks)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks in the process set (the world by default), on every rank."""
    return tf.constant(len(_set_ranks(process_set_id)), dtype=tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(_basics.local_size(), dtype=tf.int32, name=name)


def rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(rank(), dtype=tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(_basics.local_rank(), dtype=tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank is in the process set, else 0."""
    return tf.constant(int(rank() in _set_ranks(process_set_id)), dtype=tf.int32, name=name)
