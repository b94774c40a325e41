"""Elastic Keras: ``KerasState`` and the callbacks that keep it current.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(..., epochs=epochs - state.epoch, callbacks=callbacks)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..elastic import TensorFlowKerasState, run
from ..elastic import TensorFlowKerasState as KerasState

__all__ = ["CommitStateCallback", "KerasState", "TensorFlowKerasState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]

_Callback: Any = tf.keras.callbacks.Callback


class CommitStateCallback(_Callback):
    """Commits the state every ``batches_per_commit`` batches, counted from the start
    of each ``fit``, and at each epoch's end.

    Every rank must commit after the same batches: a commit ends with an
    agreement among the ranks. After a reset, ranks may have failed at
    different points of a step (one inside a commit, one in the next step's
    allreduce), so each ``fit`` counts afresh, as Horovod's callback does.
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining <= 0:
            self.batches_remaining = self.batches_per_commit
            self.state.commit()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(_Callback):
    """Keeps ``state.batch`` at the number of batches done in the current epoch."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.steps_per_epoch = (self.params or {}).get("steps")

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(_Callback):
    """Keeps ``state.epoch`` at the number of finished epochs, across restarts of ``fit``."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        # fit(epochs=epochs - state.epoch) counts from 0 again after each reset.
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
