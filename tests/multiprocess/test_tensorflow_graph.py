"""hora.tensorflow's graph ops over a real coordinator and real Gloo: a TF1 Session graph
with sixteen independent collectives of mixed dtypes never deadlocks, whatever the
inter-op pool size (one and two threads), on 2 and on 3 ranks; and hora's errors are
TensorFlow's classes (eager, tf.function, Session graph).

One multi-process run per rank count checks everything (tests/multiprocess/tf_graph_scenarios.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from tf_graph_scenarios import GRAPH_CALLS, THREADS, splits_of, value

from tests.support.coordinator import CoordinatorProcess
from tests.support.workers import run_workers

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed", allow_module_level=True)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCENARIOS = Path(__file__).with_name("tf_graph_scenarios.py")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTEROP_THREADS": "2",
       "TF_NUM_INTRAOP_THREADS": "1"}


def _expected(key: str, call: str, dtypes: list[str], rank: int, size: int) -> list[np.ndarray]:
    full = [value(r, 2 * size) for r in range(size)]
    ragged = [value(r, r + 1) for r in range(size)]
    if call == "allreduce":
        stack = np.stack(full)
        return [{"sum": stack.sum(0), "avg": stack.sum(0) / size, "max": stack.max(0)}[
            key.split("_")[0]]]
    if call == "allgather":
        return [np.concatenate(ragged)]
    if call == "broadcast":
        return [full[size - 1 if "f32" in key else 0]]
    if call == "alltoall":
        sent = [np.split(value(s, sum(splits_of(s, size))), np.cumsum(splits_of(s, size))[:-1])
                for s in range(size)]
        return [np.concatenate([sent[s][rank] for s in range(size)]),
                np.array([splits_of(s, size)[rank] for s in range(size)], np.float64)]
    if call == "alltoall_even":
        return [np.concatenate([np.split(full[s], size)[rank] for s in range(size)])]
    if call == "reducescatter":
        return [np.stack(full).sum(0)[2 * rank:2 * rank + 2]]
    if call == "grouped_allreduce":
        return [np.stack(full).sum(0)] * len(dtypes)
    if call == "grouped_allgather":
        return [np.concatenate(ragged)] * len(dtypes)
    return [np.stack(full).sum(0)[2 * rank:2 * rank + 2]] * len(dtypes)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def runs(request):
    """(size, every rank's results): one launch per rank count."""
    with CoordinatorProcess(["--lease-s", "10"]) as coordinator:
        return request.param, [r.value for r in run_workers(
            coordinator, request.param, SCENARIOS, "everything", env=ENV, timeout=240)]


def test_a_session_graph_of_independent_collectives_never_deadlocks(runs):
    size, results = runs
    for rank, got in enumerate(r["graph"] for r in results):
        for threads in THREADS:
            for key, call, dtypes in GRAPH_CALLS:
                expected = _expected(key, call, dtypes, rank, size)
                assert len(got[threads][key]) == len(expected), key
                for actual, want in zip(got[threads][key], expected, strict=True):
                    np.testing.assert_allclose(actual, want, rtol=1e-2, err_msg=key)
            total = sum(value(r, 2 * size) for r in range(size))
            np.testing.assert_allclose(got[(threads, "alone")][0], total)
            np.testing.assert_allclose(got[(threads, "fed")][0],
                                       [size, size * (size - 1) / 2])
            # d/dw sum(allgather(3w)^2): the average over ranks of the gradient of the
            # gathered tensor (the same everywhere), this rank's rows, times 3.
            np.testing.assert_allclose(got[(threads, "grad")][0],
                                       18 * np.array([rank + 1, 2.0]))
            np.testing.assert_allclose(got[(threads, "adasum")][0], got["adasum"][0])


EXPECTED_ERRORS = {
    # key: (the class the scenario caught, the engine's error behind it)
    **{f"eager.{k}": ("TensorMismatchError", "TensorMismatchError")
       for k in ("shape", "dtype", "root", "op")},
    **{f"eager.{k}": ("InvalidCallError", "InvalidCallError")
       for k in ("splits", "divisible", "unknown_set")},
    "eager.sparse_scale": ("NotImplementedError", "NoneType"),
    "eager.global_variables": ("RuntimeError", "NoneType"),
    "function.shape": ("FailedPreconditionError", "TensorMismatchError"),
    "function.splits": ("InvalidArgumentError", "InvalidCallError"),
    "graph.shape": ("FailedPreconditionError", "TensorMismatchError"),
    "graph.splits": ("InvalidArgumentError", "InvalidCallError"),
    "graph.unknown_set": ("InvalidCallError", "InvalidCallError"),
    "graph.size_op_unknown": ("ValueError", "NoneType"),
}


def test_errors_are_tensorflows_classes_and_the_next_call_works(runs):
    size, results = runs
    for rank, got in enumerate(r["errors"] for r in results):
        for key, (caught, behind) in EXPECTED_ERRORS.items():
            assert got[key] == ("caught", caught, behind), (rank, key, got[key])
        # Eager errors are both TensorFlow's class and hora's.
        mro = got["eager.hvd_class"]
        assert "InvalidArgumentError" in mro and "HoraError" in mro, mro
        assert got["after"] == [float(size)] * 14
        assert got["graph.global_variables"] == [float(size + 4)] * 2  # the last rank's
        assert got["graph.sizes"] == [size, 1, int(rank == 0)]
