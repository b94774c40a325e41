"""Horovod's Keras and TensorFlow contract on hora, over a real coordinator and real Gloo:
the broadcast callback's local variables, PartialDistributedOptimizer, elastic state
after sync(), backward_passes_per_step on tf-keras and tf.compat.v1 optimizers, momentum
correction, and Horovod's semi-public helpers through the import shim.

Two runs (TensorFlow's import is the costly part): Keras 3 on 3 ranks, and tf-keras
(``TF_USE_LEGACY_KERAS=1``) on 2 ranks (tests/multiprocess/keras_scenarios.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tests.support.coordinator import CoordinatorProcess
from tests.support.workers import run_workers

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed", allow_module_level=True)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

SCENARIOS = Path(__file__).with_name("keras_scenarios.py")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTEROP_THREADS": "2",
       "TF_NUM_INTRAOP_THREADS": "1"}
KERAS3_SIZE, LEGACY_SIZE = 3, 2


class _Parts(dict):
    """One rank's results by part; a part that raised fails the tests that read it."""

    def __getitem__(self, part: str):
        value = super().__getitem__(part)
        if isinstance(value, dict) and set(value) == {"error"}:
            pytest.fail(f"{part} raised on a worker: {value['error']}")
        return value


def _run(size: int, func: str, env: dict[str, str]) -> list[dict]:
    # A 10 s lease: TensorFlow's tracing can hold a worker's GIL on a loaded machine; the
    # deadline leaves room for TensorFlow's import, minutes when the machine is loaded.
    with CoordinatorProcess(["--lease-s", "10"]) as coordinator:
        return [_Parts(r.value) for r in run_workers(coordinator, size, SCENARIOS, func,
                                                     env=env, timeout=480)]


@pytest.fixture(scope="module")
def keras3():
    return _run(KERAS3_SIZE, "keras3", ENV)


@pytest.fixture(scope="module")
def legacy():
    if importlib.util.find_spec("tf_keras") is None:
        pytest.skip("tf-keras is not installed")
    return _run(LEGACY_SIZE, "legacy", {**ENV, "TF_USE_LEGACY_KERAS": "1"})


@pytest.fixture(params=["keras3", "legacy"])
def run(request):
    return request.getfixturevalue(request.param)


def _close(actual, expected, tol=1e-5):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


def test_broadcast_callback_leaves_local_variables_alone(run):
    for rank, got in enumerate(r["broadcast"] for r in run):
        values = got["values"]
        for i, (name, value) in enumerate(values.items()):
            # Variable i was made rank * 10 + i on every rank; the root's (rank 0) wins.
            assert value == (rank * 10.0 + i if name == got["local"] else float(i)), name
        assert got["errors"] == ["All local variables must be of tf.Variable type."] * 2


def test_partial_distributed_optimizer_keeps_local_layers_local(run):
    size = len(run)
    mean = np.mean(range(1, size + 1))
    for rank, got in enumerate(r["partial"] for r in run):
        for scale in (True, False):
            shared_kernel, shared_bias, local_kernel, local_bias = got[("eager", scale)]
            _close(shared_kernel, np.full_like(shared_kernel, mean))
            _close(shared_bias, np.full_like(shared_bias, mean))
            local = (rank + 1) / size if scale else rank + 1
            _close(local_kernel, np.full_like(local_kernel, local))
            _close(local_bias, np.full_like(local_bias, local))
        averaged = [np.mean([r["partial"]["own"][i] for r in run], 0) for i in range(4)]
        expected = averaged[:2] + [g / size for g in got["own"][2:]]
        for step, want in zip(got["fit"], expected, strict=True):
            _close(step, want)
        assert got["error"] == "All local layers must be of tf.keras.layers.Layer type."


def test_every_state_restores_to_what_sync_gave_it(run):
    # Rank r made every value r + 1; sync() gave it rank 0's (1.0, and epoch 0).
    states = [r["elastic"] for r in run]
    assert [got["keras"][0] for got in states] == [[1.0] * len(states[0]["keras"][0])] * len(run)
    assert [got["keras"][1] for got in states] == [0] * len(run)
    assert [got["tensorflow"] for got in states] == [([1.0, 1.0], 0)] * len(run)
    assert [got["torch"] for got in states] == [([[1.0, 1.0], [1.0]], 0)] * len(run)
    assert [got["object"] for got in states] == [(0, [0])] * len(run)
    # A model put in the state is saved as it is then (Horovod's set_value).
    assert [got["torch_replaced"] for got in states] == [[[5.0, 5.0], [5.0]]] * len(run)
    # An LR scheduler has its handler: rank 0's schedule, restored as synchronised.
    assert [got["scheduler"] for got in states] == [((0, 0.1), (0, 0.1))] * len(run)


def test_v1_optimizer_aggregates_passes_like_one_process_on_the_big_batch(keras3):
    passes = 2
    for got in (r["v1"] for r in keras3):
        for mode in ("eager", "graph"):
            for average in (True, False):
                seen, step = got[(mode, average)]
                assert step == len(seen)  # every pass counts, applied or not
                # Nothing moves until the last pass of an update.
                np.testing.assert_array_equal(seen[0], np.ones((3, 1)))
                assert not np.allclose(seen[passes - 1], 1.0)
                np.testing.assert_array_equal(seen[passes], seen[passes - 1])
                _close(seen[-1], got[("alone", average)])
        _close(got[("eager", True)][0][-1], keras3[0]["v1"][("eager", True)][0][-1])


def _assert_aggregation(runs: list[dict], kinds: list[str]) -> None:
    for got in (r["aggregation"] for r in runs):
        for kind in kinds:
            for average in (True, False):
                distributed, alone, _ = got[(kind, average)]
                for d, a, initial in zip(distributed, alone, got["initial"], strict=True):
                    assert not np.allclose(a, initial, atol=1e-3)  # training moved them
                    _close(d, a, 1e-4)
                first = runs[0]["aggregation"][(kind, average)][0]
                for d, f in zip(distributed, first, strict=True):
                    np.testing.assert_array_equal(d, f)  # every rank alike, bit for bit


def test_keras3_aggregation_sums_or_averages_the_passes(keras3):
    _assert_aggregation(keras3, ["new"])


def test_tf_keras_aggregation_equals_one_process_on_the_big_batch(legacy):
    _assert_aggregation(legacy, ["new", "legacy"])
    for got in (r["aggregation"] for r in legacy):
        for kind in ("new", "legacy"):
            # Horovod counts every pass in the optimizer's iterations, applied or not.
            assert got[(kind, True)][2] == got["steps"]


def test_momentum_correction_scales_momentum_for_the_batch_only(run):
    for got in (r["lr"] for r in run):
        steps, epochs = 4, 3
        during, after = got["schedule"]
        # Epochs 0: the optimizer's own 0.1; 1 and 2: 0.1 * 0.5 ** (epoch - 1).
        lrs = [0.1] * steps + [0.1] * steps + [0.05] * steps
        momenta = [0.9] * (2 * steps) + [0.9 * 0.5] + [0.9] * (steps - 1)
        _close([lr for lr, _ in during], lrs)
        _close([m for _, m in during], momenta)
        _close(after, [0.9] * (steps * epochs))
        during, after = got["warmup"]
        size = 3 if not got["legacy"] else 2
        expected_lr, expected_m, old = [], [], 0.1
        for epoch in range(epochs):
            for batch in range(steps):
                if epoch < 2:
                    e = epoch + batch / steps + 1 / steps
                    lr = 0.1 / size * (e * (size - 1) / 2 + 1)
                    expected_m.append(0.9 * lr / old)
                    old = lr
                else:
                    lr = old
                    expected_m.append(0.9)
                expected_lr.append(lr)
        _close([lr for lr, _ in during], expected_lr)
        _close([m for _, m in during], expected_m)
        _close(after, [0.9] * (steps * epochs))
        if got["legacy"]:
            # tf-keras's legacy optimizers hold momentum in a variable the step reads.
            assert got[("schedule", "weights_differ")] and got[("warmup", "weights_differ")]


def test_horovods_semi_public_helpers_through_the_shim(keras3):
    for rank, got in enumerate(r["helpers"] for r in keras3):
        assert got["missing"] == []
        assert got["eager"] is True and got["util_eager"] is True and got["in_graph"] is False
        assert got["env"] == (rank, KERAS3_SIZE)
        every = list(range(KERAS3_SIZE))
        assert got["ids"] == ({0: every, 1: [0, KERAS3_SIZE - 1]},) * 2
        assert got["after"] == {0: every}
        assert got["average_fn"] is True
        total = KERAS3_SIZE * (KERAS3_SIZE + 1) / 2
        assert got["keras_ops"] == ((KERAS3_SIZE - 1) / 2, [[total, total]])
