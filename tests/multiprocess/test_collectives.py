"""Every collective and op over a real coordinator and real Gloo, at 2 and 3 ranks.

Each rank's result is checked against a reference computed in this process
from every rank's input.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scenarios import DTYPES, OPS, make_input

from tests.support.workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

SCENARIOS = Path(__file__).with_name("scenarios.py")
IN_PLACE = Path(__file__).with_name("scenarios_in_place.py")
SIZES = [2, 3]


def values(results):
    return [r.value for r in results]


def reduce_ref(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack([t.to(torch.float64) for t in inputs])
    if op == "Sum":
        return stack.sum(0)
    if op == "Average":
        mean = stack.sum(0) / len(inputs)
        return mean if inputs[0].is_floating_point() else mean.trunc()
    if op == "Min":
        return stack.min(0).values
    if op == "Max":
        return stack.max(0).values
    if op == "Product":
        return stack.prod(0)
    raise ValueError(op)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype, f"dtype {actual.dtype} != {dtype}"
    tol = {torch.float16: 1e-2, torch.bfloat16: 2e-2}.get(dtype, 1e-6)
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("size", SIZES)
def test_world_info(shared_coordinator, size):
    infos = values(run_workers(shared_coordinator, size, SCENARIOS, "world_info"))
    assert [i["rank"] for i in infos] == list(range(size))
    for info in infos:
        assert info["size"] == size
        assert info["local_size"] == size and info["local_rank"] == info["rank"]
        assert info["cross_size"] == 1 and info["cross_rank"] == 0
        assert info["is_homogeneous"] and info["is_initialized"]
        assert info["gloo_built"] is True
        assert info["mpi_built"] is False and info["ccl_built"] is False
        assert info["nccl_built"] is False or isinstance(info["nccl_built"], int)


@pytest.mark.parametrize("size", SIZES)
def test_allreduce_every_dtype_and_op(shared_coordinator, size):
    dtypes = list(DTYPES)
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "allreduce_matrix",
                                 (dtypes, OPS)))
    for dname in dtypes:
        dtype = DTYPES[dname]
        inputs = [make_input(r, dtype, (3, 4)) for r in range(size)]
        for op in OPS:
            expected = reduce_ref(inputs, op)
            for rank, result in enumerate(results):
                for flavour in ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_"):
                    actual = result[(dname, op, flavour)]
                    try:
                        assert_close(actual, expected, dtype)
                    except AssertionError as exc:
                        raise AssertionError(f"{flavour} {dname} {op} rank {rank}: {exc}") from exc


@pytest.mark.parametrize("size", SIZES)
def test_allreduce_prescale_postscale(shared_coordinator, size):
    dtypes = ["float32", "float64", "int32", "int64", "float16", "bfloat16"]
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "allreduce_scaled",
                                 (dtypes,)))
    for dname in dtypes:
        dtype = DTYPES[dname]
        inputs = [make_input(r, dtype, (5,)) for r in range(size)]
        total = torch.stack([t.to(torch.float64) * 0.5 for t in inputs])
        if not dtype.is_floating_point:
            total = total.trunc()
        for op, divisor in (("Sum", 1), ("Average", size)):
            expected = total.sum(0) * 4.0 / divisor
            if not dtype.is_floating_point:
                expected = expected.trunc()
            for result in results:
                assert_close(result[(dname, op)], expected, dtype)


@pytest.mark.parametrize("size", [2])
def test_allreduce_views_scalars_and_auto_names(shared_coordinator, size):
    results = values(run_workers(shared_coordinator, size, SCENARIOS,
                                 "allreduce_unnamed_and_noncontiguous"))
    inputs = [make_input(r, torch.float32, (4, 6)) for r in range(size)]
    total = torch.stack(inputs).sum(0)
    for result in results:
        torch.testing.assert_close(result["r1"], total.t())
        torch.testing.assert_close(result["base_after"], total)
        assert result["scalar"].shape == torch.Size([])
        assert result["scalar"].item() == sum(range(size))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype_name", ["float32", "int64"])
def test_grouped_allreduce(shared_coordinator, size, dtype_name):
    dtype = DTYPES[dtype_name]
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "grouped", (dtype_name,)))
    shapes = [(3,), (2, 2), (5, 1)]
    for result in results:
        for i, shape in enumerate(shapes):
            inputs = [make_input(r, dtype, shape, salt=i) for r in range(size)]
            assert_close(result["sum"][i], reduce_ref(inputs, "Sum"), dtype)
            assert_close(result["inplace"][i], reduce_ref(inputs, "Sum"), dtype)
            assert_close(result["avg"][i], reduce_ref(inputs, "Average"), dtype)


@pytest.mark.parametrize("size", SIZES)
def test_a_group_of_mixed_dtypes_is_reduced_as_horovod_reduces_it(shared_coordinator, size):
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "grouped_mixed_dtypes"))
    specs = [(torch.float32, (3,)), (torch.float64, (2, 2)), (torch.int32, (4,)),
             (torch.float16, (0, 2)), (torch.float32, (1,))]
    inputs = [[make_input(r, dtype, shape, salt=i) for r in range(size)]
              for i, (dtype, shape) in enumerate(specs)]
    floats = [i for i, (dtype, _) in enumerate(specs) if dtype.is_floating_point]
    for result in results:
        for i, (dtype, shape) in enumerate(specs):
            for key, op in (("sum", "Sum"), ("max", "Max")):
                got = result[key][i]
                assert got.dtype == dtype and got.shape == torch.Size(shape)
                assert_close(got, reduce_ref(inputs[i], op), dtype)
        for got, i in zip(result["avg"], floats, strict=True):
            assert got.dtype == specs[i][0]
            assert_close(got, reduce_ref(inputs[i], "Average"), specs[i][0])
        assert result["after"].tolist() == [float(size)] * 2


@pytest.mark.parametrize("size", SIZES)
def test_allgather_ragged_first_dimension(shared_coordinator, size):
    dtypes = list(DTYPES)
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "allgather_ragged",
                                 (dtypes,)))
    for dname in dtypes:
        dtype = DTYPES[dname]
        expected = torch.cat([make_input(r, dtype, (r + 1, 3)) for r in range(size)])
        for result in results:
            assert_close(result[(dname, "sync")], expected, dtype)
            assert_close(result[(dname, "async")], expected, dtype)
    empty_expected = torch.cat([torch.full((r, 2), float(r)) for r in range(size)])
    one_d = torch.cat([torch.arange(r + 2) for r in range(size)])
    for result in results:
        torch.testing.assert_close(result["empty_on_rank0"], empty_expected)
        torch.testing.assert_close(result["1d"], one_d)


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_from_every_root(shared_coordinator, size):
    dtypes = list(DTYPES)
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "broadcasts", (dtypes,)))
    for dname in dtypes:
        dtype = DTYPES[dname]
        for root in sorted({0, size - 1}):
            expected = make_input(root, dtype, (2, 3))
            for result in results:
                for flavour in ("broadcast", "broadcast_", "broadcast_async_", "broadcast_async"):
                    assert_close(result[(dname, root, flavour)], expected, dtype)


@pytest.mark.parametrize("size", SIZES)
def test_alltoall_with_and_without_splits(shared_coordinator, size):
    dtypes = ["float32", "float64", "int32", "int64", "float16", "bfloat16"]
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "alltoalls", (dtypes,)))
    for dname in dtypes:
        dtype = DTYPES[dname]
        xs = [make_input(r, dtype, (2 * size, 3)) + r * 10 for r in range(size)]
        all_splits = [[(r + s) % 3 for s in range(size)] for r in range(size)]
        ys = [make_input(r, dtype, (sum(all_splits[r]), 2)) for r in range(size)]
        for me, result in enumerate(results):
            even = torch.cat([xs[r][2 * me:2 * me + 2] for r in range(size)])
            assert_close(result[(dname, "even")], even, dtype)
            assert_close(result[(dname, "async")], even, dtype)
            pieces = []
            for r in range(size):
                start = sum(all_splits[r][:me])
                pieces.append(ys[r][start:start + all_splits[r][me]])
            out, received = result[(dname, "splits")]
            assert_close(out, torch.cat(pieces), dtype)
            assert received.tolist() == [all_splits[r][me] for r in range(size)]
            assert_close(result[(dname, "splits_tensor")], torch.cat(pieces), dtype)


@pytest.mark.parametrize("size", SIZES)
def test_reducescatter_even_and_uneven(shared_coordinator, size):
    dtypes = ["float32", "float64", "int32", "int64", "float16", "bfloat16"]
    ops = ["Sum", "Average", "Min", "Max"]
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "reducescatters",
                                 (dtypes, ops)))
    for dname in dtypes:
        dtype = DTYPES[dname]
        for op in ops:
            for rows in (2 * size, 2 * size + 1):
                full = reduce_ref([make_input(r, dtype, (rows, 2)) for r in range(size)], op)
                counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
                for me, result in enumerate(results):
                    start = sum(counts[:me])
                    assert_close(result[(dname, op, rows)], full[start:start + counts[me]], dtype)


@pytest.mark.parametrize("size", [2])
def test_barrier_poll_synchronize(shared_coordinator, size):
    results = values(run_workers(shared_coordinator, size, SCENARIOS,
                                 "barrier_poll_synchronize"))
    # Rank 1 reached the barrier 0.5 s before rank 0 and had to wait for it.
    assert results[1]["waited"] > 0.3
    for result in results:
        torch.testing.assert_close(result["result"], torch.ones(1000) * sum(range(size)))
        assert result["again"] is None and result["bogus"] is None
        assert result["polled_again"] == "InvalidCallError"  # a ValueError, as Horovod's
        torch.testing.assert_close(result["after"], torch.full((2,), float(size)))


@pytest.mark.parametrize("size", SIZES)
def test_in_place_collectives_on_leaves_that_require_grad(shared_coordinator, size):
    """Horovod runs ``allreduce_(w)`` on a leaf that requires grad; hora failed
    it with an internal error at the average's division, and then every later
    call of the world."""
    results = values(run_workers(shared_coordinator, size, IN_PLACE, "in_place_on_leaves"))
    ranks = range(size)
    for result in results:
        for op in ("Average", "Sum", "Max"):
            same, value, leaf, requires_grad = result[op]
            assert same and leaf and requires_grad
            expected = reduce_ref([make_input(r, torch.float32, (3, 4)) for r in ranks], op)
            assert_close(value, expected, torch.float32)
        a, b = result["group"]
        assert_close(a, reduce_ref([make_input(r, torch.float64, (5,)) for r in ranks],
                                   "Sum"), torch.float64)
        assert_close(b, reduce_ref([make_input(r, torch.float64, (2, 2), salt=1)
                                    for r in ranks], "Sum"), torch.float64)
        assert_close(result["async"], reduce_ref(
            [make_input(r, torch.float32, (6,), salt=2) for r in ranks], "Average"),
            torch.float32)
        assert_close(result["broadcast"], make_input(1, torch.float32, (4,), salt=3),
                     torch.float32)
        assert_close(result["grad"], torch.full((3, 4), 2.0), torch.float32)
        assert_close(result["after"], torch.full((3,), float(size)), torch.float32)


@pytest.mark.parametrize("size", [2])
def test_polled_allreduces_complete_beside_waited_ones(shared_coordinator, size):
    """A waited allreduce does not wake the engine's background thread (its caller
    runs the round); allreduces that are only polled must still complete."""
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "waited_then_polled"))
    ranks = range(size)
    for result in results:
        for i, got in enumerate(result["waited"]):
            torch.testing.assert_close(got, torch.full((4,), float(sum(r + i for r in ranks))))
        for i, got in enumerate(result["polled"]):
            torch.testing.assert_close(got, torch.full((4,), float(sum(r * i for r in ranks))))
        for i, got in enumerate(result["threaded"]):
            torch.testing.assert_close(got,
                                       torch.full((3,), float(sum(r + 10 * i for r in ranks))))


@pytest.mark.parametrize("size", [2])
def test_gradients_flow_through_collectives(shared_coordinator, size):
    results = values(run_workers(shared_coordinator, size, SCENARIOS, "differentiable"))
    for rank, result in enumerate(results):
        # d/dx sum(allreduce_sum(x)) = allreduce_sum(ones) = size
        torch.testing.assert_close(result["allreduce"], torch.full((2, 2), float(size)))
        # allgather weights row block r by (row index + 1); as in Horovod, the
        # incoming gradients are averaged over the ranks (every rank sends the same).
        rows = torch.arange(2 * size).reshape(size, 2)[rank] + 1
        expected = rows.float().reshape(2, 1).expand(2, 2)
        torch.testing.assert_close(result["allgather"], expected)
        # broadcast: the root gets the average of the incoming gradients (ones), others zeros.
        root_grad = torch.ones(2, 2) if rank == 0 else torch.zeros(2, 2)
        torch.testing.assert_close(result["broadcast"], root_grad)


@pytest.mark.parametrize("size", [2])
def test_a_tensor_that_cannot_be_written_fails_its_call_and_not_the_world(shared_coordinator,
                                                                          size):
    """An expanded tensor given to an in-place collective failed with an
    internal error in the write-back, and every later call of the world with
    it; so did a tensor resized while its allreduce was in flight."""
    results = values(run_workers(shared_coordinator, size, IN_PLACE,
                                 "in_place_on_shared_memory_elements"))
    for rank, result in enumerate(results):
        for call in ("allreduce_", "broadcast_", "grouped_allreduce_"):
            is_value_error, message = result[call]
            assert is_value_error and "share memory" in message and "expand()" in message
            torch.testing.assert_close(result[f"{call}.after"], torch.full((2,), 2.0))
        torch.testing.assert_close(result["allreduce"], torch.full((4,), 3.0))
        torch.testing.assert_close(result["resized.after"], torch.full((2,), 2.0))
        torch.testing.assert_close(result["fused.other"], torch.full((3,), 2.0))
        torch.testing.assert_close(result["fused.after"], torch.full((2,), 2.0))
        if rank == 1:  # (rank 0's allreduce may complete before it resizes)
            for key in ("resized", "fused.resized"):
                is_value_error, message = result[key]
                assert is_value_error and "could not write its result back" in message
