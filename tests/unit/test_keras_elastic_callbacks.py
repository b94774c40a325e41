"""Elastic Keras's ``CommitStateCallback``: when it commits, after a failure too.

A worker lost while the others are inside a commit (the host-update agreement
that ``commit`` ends with) fails that commit on them, while a rank that had
already left the agreement fails in the next step's allreduce instead. Both
restore, re-join and call ``fit`` again with the same callbacks; from then on
every rank must commit after the same batches, or the one that skips a commit
waits in the next step's allreduce while its peer waits in the commit's
agreement (seen under ``horovodrun`` with a worker killed: twice in 30
kills made just after an epoch began, the job hung). Real Keras ``fit`` and
the real retry loop (``hora.elastic.run_fn``); the state's host-update
agreement is replaced by a counter that can fail, since there is no peer here.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed", allow_module_level=True)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hora.elastic import ObjectState, run_fn  # noqa: E402
from hora.errors import HorovodInternalError  # noqa: E402
from hora.tensorflow.keras.elastic import CommitStateCallback  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

STEPS = 6


class _CountedState(ObjectState):
    """An ObjectState whose commits are recorded by (fit call, batch), and whose
    ``fail_at``-th commit raises as a lost peer makes the agreement raise."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(bcast_object=lambda obj: obj, get_rank=lambda: 0, batch=0)
        self.fail_at = fail_at
        self.commits = 0
        self.fit_call = 0
        self.committed_at: list[tuple[int, int]] = []

    def check_host_updates(self) -> None:
        self.commits += 1
        if self.commits == self.fail_at:
            raise HorovodInternalError("rank 2's connection broke during the agreement")
        self.committed_at.append((self.fit_call, self.batch))


class _Batch(tf.keras.callbacks.Callback):
    """Keeps ``state.batch``; ``fail_after``: the batch of the first fit after which a
    collective fails (as the next step's allreduce would, its peer lost)."""

    def __init__(self, state: _CountedState, fail_after: int | None) -> None:
        super().__init__()
        self.state = state
        self.fail_after = fail_after

    def on_train_begin(self, logs: object = None) -> None:
        self.state.fit_call += 1

    def on_batch_begin(self, batch: int, logs: object = None) -> None:
        # (Every callback has seen batch ``fail_after``'s end.)
        if self.state.fit_call == 1 and batch == self.fail_after:
            raise HorovodInternalError("the step's allreduce lost a peer")

    def on_batch_end(self, batch: int, logs: object = None) -> None:
        self.state.batch = batch + 1


def _commits_of_a_training(batches_per_commit: int, fail_at: int = 0, fail_after: int | None = None,
               epochs: int = 1) -> list[tuple[int, int]]:
    """(fit call, batch) of each commit of a training under the retry loop: the
    first fit fails at commit ``fail_at`` or in the step after batch
    ``fail_after``; the loop then calls fit again with the same callbacks."""
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((64, 4), "float32"), np.ones((64, 1), "float32"))).repeat().batch(8)
    state = _CountedState(fail_at)
    # The batch counter first: commit sees the batch just done.
    callbacks = [_Batch(state, fail_after), CommitStateCallback(state, batches_per_commit)]

    def train(state: _CountedState) -> None:
        model.fit(data, steps_per_epoch=STEPS, epochs=epochs, verbose=0, callbacks=callbacks)

    run_fn(train, reset=lambda: None)(state)
    return state.committed_at


@pytest.mark.parametrize("fail_at", [1, 2])
def test_after_a_failed_commit_the_next_fit_commits_after_every_batch(fail_at):
    committed = _commits_of_a_training(batches_per_commit=1, fail_at=fail_at)
    # The first fit ended at the failed commit (batch fail_at); the second commits
    # after each of its batches, and again at the epoch's end.
    assert committed == [(1, b) for b in range(1, fail_at)] + \
        [(2, b) for b in range(1, STEPS + 1)] + [(2, STEPS)]


@pytest.mark.parametrize("fail_at", [1, 2])
def test_with_batches_per_commit_the_next_fit_counts_from_its_first_batch(fail_at):
    committed = _commits_of_a_training(batches_per_commit=2, fail_at=fail_at)
    # A new fit counts batches from its own start, as every rank's does.
    assert committed == [(1, 2 * c) for c in range(1, fail_at)] + \
        [(2, 2), (2, 4), (2, 6), (2, STEPS)]


def test_a_fit_after_a_failed_step_counts_from_its_first_batch():
    # The first fit fails in its fourth step, one batch after a commit: the next
    # fit commits after its 2nd, 4th and 6th batches, as every rank's does
    # whatever batch each had failed at.
    committed = _commits_of_a_training(batches_per_commit=2, fail_after=3)
    assert committed == [(1, 2), (2, 2), (2, 4), (2, 6), (2, STEPS)]


def test_every_epoch_ends_with_a_commit():
    # 6 batches per epoch, a commit every 4 batches counted across epochs (after
    # the 4th, 8th and 12th) and one at each epoch's end, as in Horovod.
    committed = _commits_of_a_training(batches_per_commit=4, epochs=2)
    assert committed == [(1, 4), (1, 6), (1, 2), (1, 6), (1, 6)]
