"""``backward_passes_per_step``: gradients summed on each rank over N passes, reduced once.

For optimizers that have no accumulation of their own (tf-keras's, new and
legacy, and ``tf.compat.v1.train.Optimizer``): Horovod's local gradient
aggregation. Every pass adds its gradients to a local accumulator; the N-th
reduces the accumulated gradients over the ranks (summed, or divided by N with
``average_aggregated_gradients``) and applies them; the other passes apply
nothing, only counting the step. It works eagerly and inside ``tf.function``:
the choice is a ``tf.cond`` on a counter that every rank holds alike, so every
rank takes the same branch and runs the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from ._gradients import GradientReducer

__all__ = ["LocalAggregator"]


class LocalAggregator:
    """Sums gradients over ``passes`` calls and reduces them on the last one.

    Use :meth:`compute` where the gradients are made (it returns what to apply)
    and :meth:`apply` around the optimizer's own apply.
    """

    def __init__(self, reducer: GradientReducer, passes: int, average: bool) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.reducer = reducer
        self.passes = passes
        self.average = average
        self.counter: Any = None
        self._sums: list[Any] | None = None

    def _build(self, grads: Sequence[Any]) -> None:
        if self._sums is not None:
            if len(self._sums) != len(grads):
                raise ValueError(f"backward_passes_per_step: {len(grads)} gradients, but "
                                 f"the first step had {len(self._sums)}")
            return
        # Made once, outside any tf.function's graph, and never trained or saved.
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                       name="hora_aggregation_counter")
            self._sums = [None if g is None else
                          tf.Variable(tf.zeros(g.dense_shape if isinstance(g, tf.IndexedSlices)
                                               else g.shape, dtype=g.dtype),
                                      trainable=False, name="hora_aggregated_gradient")
                          for g in grads]

    def compute(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """Adds ``grads`` to the sums; on the N-th pass returns the reduced sums (and
        starts over), on the others the gradients as they came."""
        grads = list(grads)
        self._build(grads)
        assert self._sums is not None
        sums = self._sums
        for total, grad in zip(sums, grads, strict=True):
            if total is not None:
                total.assign_add(tf.convert_to_tensor(grad))
        self.counter.assign_add(1)
        present = [i for i, total in enumerate(sums) if total is not None]
        divisor = float(self.passes) if self.average else 1.0

        def reduce() -> list[Any]:
            summed = [sums[i].read_value() for i in present]
            reduced = self.reducer.reduce(summed, [variables[i] for i in present])
            out = [r / tf.cast(divisor, r.dtype) if divisor != 1.0 else tf.identity(r)
                   for r in reduced]
            with tf.control_dependencies(out):
                for i in present:
                    sums[i].assign(tf.zeros_like(sums[i]))
                self.counter.assign(0)
            return [tf.identity(r) for r in out]

        def keep() -> list[Any]:
            return [tf.identity(tf.convert_to_tensor(grads[i])) for i in present]

        chosen = tf.cond(tf.equal(self.counter, self.passes), reduce, keep)
        chosen = chosen if isinstance(chosen, (list, tuple)) else [chosen]
        out: list[Any] = [None] * len(grads)
        for i, value in zip(present, chosen, strict=True):
            out[i] = value
        return out

    def apply(self, apply: Callable[[], Any], skipped: Callable[[], Any]) -> Any:
        """Runs ``apply`` on the pass that reduced (the counter is back at 0), and
        ``skipped`` (which counts the step) on the others."""

        def on_update() -> Any:
            apply()
            return tf.constant(True)

        def on_skip() -> Any:
            skipped()
            return tf.constant(False)

        return tf.cond(tf.equal(self.counter, 0), on_update, on_skip)
