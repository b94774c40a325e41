"""Horovod's Keras callbacks: broadcast, metric averaging, learning-rate warmup and schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from ..functions import broadcast_variables
from ..mpi_ops import Average, allreduce, global_process_set, size

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]

_Callback: Any = tf.keras.callbacks.Callback


def _model_and_optimizer_variables(model: Any) -> list[Any]:
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables() if callable(optimizer.variables)
                          else optimizer.variables)
    return variables


class BroadcastGlobalVariablesCallback(_Callback):
    """Makes every rank start from the root rank's weights and optimizer state.

    The model's variables go out when training begins; the optimizer's,
    which Keras may create only in the first step, go out again after the
    first batch (as Horovod does).
    """

    def __init__(self, root_rank: int, device: str = "", *,
                 process_set: Any = global_process_set) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False

    def _broadcast(self) -> None:
        broadcast_variables(_model_and_optimizer_variables(self.model), self.root_rank,
                            process_set=self.process_set)

    def on_train_begin(self, logs: Any = None) -> None:
        if self.model.built:
            self._broadcast()

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True


class MetricAverageCallback(_Callback):
    """Averages the epoch's metrics over the ranks, so that every rank logs the same values.

    Put it before callbacks that read the metrics (ReduceLROnPlateau, TensorBoard, checkpoints).
    """

    def __init__(self, device: str = "", *, process_set: Any = global_process_set) -> None:
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0
                      and isinstance(float(v), float))
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        averaged = allreduce(values, op=Average, name=f"metric_average.{epoch}",
                             process_set=self.process_set).numpy()
        for key, value in zip(keys, averaged, strict=True):
            logs[key] = float(value)


def _set_lr(optimizer: Any, value: float) -> None:
    lr = optimizer.learning_rate
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        optimizer.learning_rate = value


class LearningRateScheduleCallback(_Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch``
    until ``end_epoch``.

    Args:
        initial_lr: the base learning rate (usually already scaled by ``hvd.size()``).
        multiplier: a number, or a function of the epoch (a float between epochs
            when ``staircase=False``).
        staircase: change the rate once per epoch (True) or every batch.
        steps_per_epoch: batches per epoch, for ``staircase=False``; taken from
            ``fit``'s parameters when not given.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        _set_lr(self.model.optimizer, self.initial_lr * float(self.multiplier(epoch)))

    def on_train_begin(self, logs: Any = None) -> None:
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._adjust(epoch)

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.staircase or not self._active(self.current_epoch) or not self.steps_per_epoch:
            return
        self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size`` up to ``initial_lr`` over
    ``warmup_epochs`` (Goyal et al., "Accurate, Large Minibatch SGD"), batch by batch."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            world = size()
            return 1.0 / world * (epoch * (world - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self.initial_lr:g}.")
