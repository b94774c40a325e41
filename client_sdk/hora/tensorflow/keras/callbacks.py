"""Horovod's Keras callbacks: broadcast, metric averaging, learning-rate warmup and schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from ..functions import broadcast_variables
from ..mpi_ops import Average, allreduce, global_process_set, rank, size

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
           "LearningRateScheduleCallback",
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

    Args:
        root_rank: the rank whose values every rank takes.
        device: accepted for Horovod's signature.
        local_variables: a ``tf.Variable`` or a list of them that stay as each
            rank has them (not broadcast); more with :meth:`register_local_var`.

    Raises:
        ValueError: ``local_variables`` holds something that is not a ``tf.Variable``.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None, *,
                 process_set: Any = global_process_set) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self.broadcast_done = False
        self._local_vars: set[Any] = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        elif not all(_is_variable(v) for v in local_variables):
            raise ValueError("All local variables must be of tf.Variable type.")
        for variable in local_variables:
            self.register_local_var(variable)

    def register_local_var(self, var: Any) -> None:
        """Leaves ``var`` out of the broadcast: every rank keeps its own value."""
        self._local_vars.add(_key(var))

    def _broadcast(self) -> None:
        variables = [v for v in _model_and_optimizer_variables(self.model)
                     if _key(v) not in self._local_vars]
        broadcast_variables(variables, self.root_rank, process_set=self.process_set)

    def on_train_begin(self, logs: Any = None) -> None:
        if self.model.built:
            self._broadcast()

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True


def _is_variable(value: Any) -> bool:
    # Keras 3's variables are not tf.Variables (they hold one).
    keras_variable = getattr(tf.keras, "Variable", None)
    return isinstance(value, tf.Variable) or (
        keras_variable is not None and isinstance(value, keras_variable))


def _key(variable: Any) -> Any:
    return variable.ref() if hasattr(variable, "ref") else id(variable)


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


def _get(optimizer: Any, name: str) -> float:
    return float(np.asarray(getattr(optimizer, name)))


def _set(optimizer: Any, name: str, value: float) -> None:
    current = getattr(optimizer, name)
    if hasattr(current, "assign"):
        current.assign(value)
    else:  # tf-keras's legacy optimizers turn this into their hyperparameter's assign
        setattr(optimizer, name, value)


class LearningRateScheduleCallback(_Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch``
    until ``end_epoch``.

    Args:
        initial_lr: the base learning rate (usually already scaled by ``hvd.size()``).
        multiplier: a function of the epoch (a float between epochs when
            ``staircase=False``), or a number ``m``: an exponential decay,
            ``m ** (epoch - start_epoch)``.
        staircase: change the rate at the first batch of each epoch (True) or at
            every batch.
        momentum_correction: while a batch runs at a changed rate, scale the
            optimizer's ``momentum`` by ``new_lr / old_lr`` (restored after the
            batch), as in Goyal et al. With a Keras 3 optimizer, whose momentum is a
            Python number traced into the compiled step, this takes effect only in
            ``run_eagerly`` models; tf-keras's legacy optimizers hold it in a variable.
        steps_per_epoch: batches per epoch, for ``staircase=False``; taken from
            ``fit``'s parameters when not given.

    Raises:
        ValueError: ``initial_lr`` is None.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = multiplier
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.restore_momentum: float | None = None
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError(f"Could not autodetect the number of steps per epoch: pass "
                         f"steps_per_epoch to {type(self).__name__}()")

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _get(optimizer, "learning_rate")
        new_lr = self.initial_lr * float(self.multiplier(epoch))
        _set(optimizer, "learning_rate", new_lr)
        if self.momentum_correction and hasattr(optimizer, "momentum") and old_lr:
            self.restore_momentum = _get(optimizer, "momentum")
            _set(optimizer, "momentum", self.restore_momentum * new_lr / old_lr)

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust(epoch)
        else:
            assert self.steps_per_epoch  # on_train_begin found it
            self._adjust(epoch + batch / self.steps_per_epoch)

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.restore_momentum:
            _set(self.model.optimizer, "momentum", self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = _get(self.model.optimizer, "learning_rate")


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size`` up to ``initial_lr`` over
    ``warmup_epochs`` (Goyal et al., "Accurate, Large Minibatch SGD"), batch by batch;
    the last batch of the warmup runs at ``initial_lr``."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # One batch ahead, so that each epoch ends on a round number.
            assert self.steps_per_epoch
            epoch += 1.0 / self.steps_per_epoch
            world = size()
            return 1.0 / world * (epoch * (world - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get(self.model.optimizer, 'learning_rate'):g}.")


class BestModelCheckpoint(tf.keras.callbacks.ModelCheckpoint):
    """A ``ModelCheckpoint`` that keeps only the best model by ``monitor``.

    Horovod's Spark estimators set ``filepath`` afterwards; a script sets it too.
    Keras 3 wants a path from the start: until one is set it is ``best_model.keras``.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: Any = "epoch") -> None:
        kwargs = dict(monitor=monitor, verbose=verbose, save_best_only=True,
                      save_weights_only=False, mode=mode, save_freq=save_freq)
        try:
            super().__init__(filepath=None, **kwargs)
        except (AttributeError, TypeError, ValueError):  # Keras 3 checks the suffix now
            super().__init__(filepath="best_model.keras", **kwargs)
