"""PairwiseAllreduce: 2 or 4 ranks (threads of this process) swap parts of tensors
over real loopback sockets, and every rank gets the reference's bits."""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterator

import pytest
import torch
from test_control_mesh import build, run_all

from hora_native import BackendError, ReduceKind
from hora_native.mesh import MESH_DTYPES, PairwiseAllreduce
from hora_native.mesh_transport import MeshTransport as ControlMesh

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

REFERENCE = {
    ReduceKind.SUM: torch.add,
    ReduceKind.PRODUCT: torch.mul,
    ReduceKind.MIN: torch.minimum,
    ReduceKind.MAX: torch.maximum,
}


@pytest.fixture(params=["sockets", "shared-memory"])
def world(request: pytest.FixtureRequest) -> Iterator[Callable[..., list[PairwiseAllreduce]]]:
    """``world(size, chunk_bytes)``: connected ranks' PairwiseAllreduce; closed after.

    Swaps go over sockets, or (the ranks share /dev/shm) through the segment
    each rank keeps for each peer; afterwards, the test checks which."""
    shared = request.param == "shared-memory"
    made: list[ControlMesh] = []

    def make(size: int, chunk_bytes: int) -> list[PairwiseAllreduce]:
        meshes = build(size, shared=shared)
        assert all(mesh.local_peers == set(range(size)) - {rank}
                   for rank, mesh in enumerate(meshes)) == shared
        made.extend(meshes)
        return [PairwiseAllreduce(mesh, rank, chunk_bytes) for rank, mesh in enumerate(meshes)]

    yield make
    swapped = sum(mesh.shared_swaps for mesh in made)
    for mesh in made:
        mesh.close()
    assert (swapped > 0) == shared or not made, f"{swapped} swaps through shared memory"
    left = [path for mesh in made for path in glob.glob(f"{mesh._prefix}*")]
    assert not left, f"segments left in /dev/shm: {left}"


def _input(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(17 + rank)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=gen, dtype=torch.float64) * 3).to(dtype)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def _allreduce(ranks: list[PairwiseAllreduce], tensors: list[torch.Tensor],
               op: ReduceKind) -> None:
    _results, errors = run_all([lambda r=r, t=t: ranks[r].allreduce(t, op)
                                for r, t in enumerate(tensors)])
    assert errors == [None] * len(ranks), errors


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("op", list(REFERENCE), ids=lambda op: op.value)
def test_every_dtype_reduces_to_the_same_bits_on_every_rank_across_chunks(world, size, op):
    # 1001-byte chunks: cut to whole elements; 2501 elements span several chunks,
    # and a chunk of odd length halves unevenly.
    ranks = world(size, chunk_bytes=1001)
    for dtype_name in sorted(MESH_DTYPES):
        dtype = getattr(torch, dtype_name)
        inputs = [_input(rank, dtype, 2501).reshape(41, 61) for rank in range(size)]
        outputs = [t.clone() for t in inputs]
        _allreduce(ranks, outputs, op)
        for rank in range(1, size):
            assert torch.equal(outputs[0].view(torch.uint8), outputs[rank].view(torch.uint8)), \
                (dtype_name, rank)
        if dtype.is_floating_point and op in (ReduceKind.SUM, ReduceKind.PRODUCT):
            # The order of a float sum or product is the algorithm's: within a few
            # roundings of the exact float64 result, each at most eps times the
            # magnitude of what was combined.
            exact, magnitude = inputs[0].double(), inputs[0].double().abs()
            for other in inputs[1:]:
                exact = REFERENCE[op](exact, other.double())
                magnitude = REFERENCE[op](magnitude, other.double().abs())
            bound = size * torch.finfo(dtype).eps * magnitude + torch.finfo(dtype).tiny
            error = (outputs[0].double() - exact).abs()
            assert bool((error <= bound).all()), (dtype_name, float((error - bound).max()))
        else:  # exact: integers, and MIN/MAX
            want = inputs[0]
            for other in inputs[1:]:
                want = REFERENCE[op](want, other)
            assert torch.equal(outputs[0], want), dtype_name
    assert [r.allreduces for r in ranks] == [len(MESH_DTYPES)] * size


@pytest.mark.parametrize("size", [2, 4])
def test_tensors_smaller_than_the_world_and_empty_ones(world, size):
    ranks = world(size, chunk_bytes=1 << 20)
    for numel in (0, 1, 3, 5):
        outputs = [torch.full((numel,), float(rank + 1)) for rank in range(size)]
        _allreduce(ranks, outputs, ReduceKind.SUM)
        total = float(sum(range(1, size + 1)))
        for out in outputs:
            assert torch.equal(out, torch.full((numel,), total)), (numel, out)


@pytest.mark.parametrize("op", [ReduceKind.MIN, ReduceKind.MAX], ids=lambda op: op.value)
def test_two_ranks_agree_on_the_sign_of_zero(world, op):
    # MIN(+0, -0) returns either zero depending on argument order; rank order
    # keeps both ranks identical.
    ranks = world(2, chunk_bytes=1 << 20)
    outputs = [torch.tensor([0.0, -0.0, 1.0]), torch.tensor([-0.0, 0.0, 1.0])]
    _allreduce(ranks, outputs, op)
    assert torch.equal(outputs[0].view(torch.int32), outputs[1].view(torch.int32))


@pytest.mark.parametrize("size", [2, 4])
def test_different_lengths_fail_with_the_byte_counts(world, size):
    ranks = world(size, chunk_bytes=1 << 20)
    tensors = [torch.ones(100 if rank == 0 else 50) for rank in range(size)]
    _results, errors = run_all([lambda r=r, t=t: ranks[r].allreduce(t, ReduceKind.SUM)
                                for r, t in enumerate(tensors)])
    assert all(isinstance(e, BackendError) for e in errors[:2]), errors
    assert "the ranks' tensors differ" in str(errors[0]), errors[0]


def test_only_worlds_of_2_or_4_ranks():
    meshes = build(3)
    try:
        with pytest.raises(ValueError, match="needs 2 or 4 ranks, got rank 0 of 3"):
            PairwiseAllreduce(meshes[0], 0)
    finally:
        for mesh in meshes:
            mesh.close()


@pytest.mark.parametrize("size", [2, 4])
def test_a_dead_peer_fails_the_allreduce_naming_it(size):
    meshes = build(size)
    try:
        ranks = [PairwiseAllreduce(mesh, rank) for rank, mesh in enumerate(meshes)]
        meshes[1].close()  # rank 1 is gone: its sockets close
        _results, errors = run_all([lambda: ranks[0].allreduce(torch.ones(1000),
                                                                ReduceKind.SUM)])
        assert isinstance(errors[0], BackendError), errors
        assert "rank 1 closed its connection" in str(errors[0]), errors[0]
    finally:
        for mesh in meshes:
            mesh.close()


def test_a_silent_peer_fails_the_allreduce_at_the_deadline():
    meshes = build(2, timeout=0.5)
    try:
        ranks = [PairwiseAllreduce(mesh, rank) for rank, mesh in enumerate(meshes)]
        # Rank 1 is alive but never takes part.
        _results, errors = run_all([lambda: ranks[0].allreduce(torch.ones(1000),
                                                                ReduceKind.SUM)])
        assert isinstance(errors[0], BackendError), errors
        assert "heard nothing from rank(s) [1] for 0.5 s" in str(errors[0]), errors[0]
    finally:
        for mesh in meshes:
            mesh.close()
