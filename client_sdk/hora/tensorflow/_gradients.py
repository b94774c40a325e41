"""Averaging gradients over the ranks: what DistributedGradientTape and the
DistributedOptimizers (TF and Keras) share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .compression import Compression
from .mpi_ops import (
    Adasum,
    Average,
    ProcessSet,
    Sum,
    allreduce,
    global_process_set,
    grouped_allreduce,
)

__all__ = ["GradientReducer"]


def _ref(source: Any) -> Any:
    return source.ref() if hasattr(source, "ref") else id(source)


def _scaled(grad: Any, factor: float) -> Any:
    if grad is None or factor == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


class GradientReducer:
    """Allreduces a list of gradients in as few calls as the grouping allows.

    Args:
        compression: ``hvd.Compression.none`` / ``.fp16`` / ``.bf16``.
        sparse_as_dense: turn ``tf.IndexedSlices`` into dense tensors first.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum`` (one allreduce per
            gradient: Adasum combines whole tensors).
        gradient_predivide_factor: with Average, divide by this before the sum
            and by ``size / factor`` after it (Horovod's split of the average).
        num_groups: split the gradients into this many grouped allreduces (0: one).
        groups: explicit groups of variables (lists of variables), or a count.
        process_set: the ranks that average.
        scale_local_gradients: divide the gradients of variables registered with
            :meth:`register_local_var` by the set's size (they are not reduced).
    """

    def __init__(self, compression: Any = Compression.none, sparse_as_dense: bool = False,
                 op: Any = Average, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: Any = None,
                 process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True) -> None:
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op == Average")
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.process_set = process_set
        self.groups = groups if groups is not None else (num_groups or None)
        self.pre, self.post = 1.0, 1.0
        self.scale_local_gradients = scale_local_gradients
        # Applied to local gradients as ``post`` is to reduced ones, for what is not an
        # average (Keras 3's accumulated passes summed the way Horovod sums them).
        self.local_post = 1.0
        self.local: set[Any] = set()
        if op == Average and gradient_predivide_factor != 1.0:
            self.op = Sum
            self.pre = 1.0 / gradient_predivide_factor
            self.post = gradient_predivide_factor / process_set.size()

    def register_local_var(self, var: Any) -> None:
        """Keeps ``var``'s gradient on this rank: not reduced, only divided by the set's
        size when ``scale_local_gradients`` (as an averaged gradient would be)."""
        self.local.add(_ref(var))

    def _chunks(self, indices: list[int], variables: Sequence[Any] | None) -> list[list[int]]:
        if isinstance(self.groups, int) and self.groups > 1:
            n = self.groups
            return [indices[i::n] for i in range(n) if indices[i::n]]
        if isinstance(self.groups, (list, tuple)) and variables is not None:
            ids = {id(v): g for g, group in enumerate(self.groups) for v in group}
            chunks: dict[Any, list[int]] = {}
            for i in indices:
                chunks.setdefault(ids.get(id(variables[i]), "rest"), []).append(i)
            return list(chunks.values())
        return [indices] if indices else []

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any] | None = None) -> list[Any]:
        """The reduced gradients, in order; ``None`` stays ``None``, and the gradients of
        local variables stay on this rank."""
        out = list(grads)
        mine = [i for i, v in enumerate(variables or ()) if _ref(v) in self.local] \
            if self.local else []
        local = {i: out[i] for i in mine}
        for i in mine:
            out[i] = None
        out = self._reduce_shared(out, variables)
        factor = self.local_post / (self.process_set.size() if self.scale_local_gradients else 1)
        for i, grad in local.items():
            out[i] = _scaled(grad, factor)
        return out

    def _reduce_shared(self, out: list[Any], variables: Sequence[Any] | None) -> list[Any]:
        if self.process_set.size() == 1 and self.pre == 1.0 and self.post == 1.0:
            return out
        dense, sparse = [], []
        for i, grad in enumerate(out):
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                if self.sparse_as_dense:
                    out[i] = tf.convert_to_tensor(grad)
                    dense.append(i)
                else:
                    sparse.append(i)
            else:
                dense.append(i)
        if self.op == Adasum:
            for i in dense:
                out[i] = allreduce(out[i], op=Adasum, compression=self.compression,
                                   process_set=self.process_set)
            dense = []
        for chunk in self._chunks(dense, variables):
            reduced = grouped_allreduce([out[i] for i in chunk], op=self.op,
                                        compression=self.compression,
                                        prescale_factor=self.pre, postscale_factor=self.post,
                                        process_set=self.process_set)
            for i, value in zip(chunk, reduced, strict=True):
                out[i] = value
        for i in sparse:
            out[i] = grouped_allreduce([out[i]], op=self.op, process_set=self.process_set)[0]
        return out
