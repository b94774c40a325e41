"""PairExchange: two ranks (threads of this process) swap whole tensors over real sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from test_control_mesh import build, run_all

from hora_native import BackendError, ReduceKind
from hora_native.mesh import MESH_DTYPES, PairExchange

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REFERENCE = {
    ReduceKind.SUM: lambda a, b: a + b,
    ReduceKind.PRODUCT: lambda a, b: a * b,
    ReduceKind.MIN: torch.minimum,
    ReduceKind.MAX: torch.maximum,
}


@pytest.fixture
def pair() -> Iterator[Callable[[int], list[PairExchange]]]:
    """Makes two connected ranks' PairExchanges (``pair(chunk_bytes)``); closes them after."""
    made = []

    def make(chunk_bytes: int) -> list[PairExchange]:
        meshes = build(2)
        made.extend(meshes)
        return [PairExchange(mesh, rank, chunk_bytes) for rank, mesh in enumerate(meshes)]

    yield make
    for mesh in made:
        mesh.close()


def _input(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(17 + rank)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=gen, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-5 if dtype != torch.uint8 else 0, 6, (numel,), generator=gen,
                         dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("op", list(REFERENCE), ids=lambda op: op.value)
def test_every_dtype_reduces_to_the_same_bits_on_both_ranks_across_chunks(pair, op):
    # 1001-byte chunks: not a multiple of any element size larger than 1, so
    # chunks are cut to whole elements; 2501 elements span several chunks.
    pairs = pair(chunk_bytes=1001)
    for dtype_name in sorted(MESH_DTYPES):
        dtype = getattr(torch, dtype_name)
        inputs = [_input(rank, dtype, 2501).reshape(41, 61) for rank in range(2)]
        outputs = [t.clone() for t in inputs]
        _results, errors = run_all([lambda r=r, t=outputs[r]: pairs[r].allreduce(t, op)
                                    for r in range(2)])
        assert errors == [None, None], (dtype_name, errors)
        want = REFERENCE[op](inputs[0], inputs[1])
        for rank in range(2):
            assert torch.equal(outputs[rank], want), (dtype_name, rank)
        assert torch.equal(outputs[0].view(torch.uint8), outputs[1].view(torch.uint8))
    assert [p.allreduces for p in pairs] == [len(MESH_DTYPES)] * 2


@pytest.mark.parametrize("op", [ReduceKind.MIN, ReduceKind.MAX], ids=lambda op: op.value)
def test_min_and_max_of_signed_zeros_give_both_ranks_the_same_bits(pair, op):
    # MIN(+0, -0) may return either zero depending on argument order; rank
    # order keeps the ranks identical.
    pairs = pair(chunk_bytes=1 << 20)
    outputs = [torch.tensor([0.0, -0.0, 1.0]), torch.tensor([-0.0, 0.0, 1.0])]
    _results, errors = run_all([lambda r=r: pairs[r].allreduce(outputs[r], op)
                                for r in range(2)])
    assert errors == [None, None]
    assert torch.equal(outputs[0].view(torch.int32), outputs[1].view(torch.int32))


def test_different_lengths_fail_on_both_ranks_with_the_lengths(pair):
    pairs = pair(chunk_bytes=1 << 20)
    tensors = [torch.ones(100), torch.ones(50)]
    _results, errors = run_all([lambda r=r: pairs[r].allreduce(tensors[r], ReduceKind.SUM)
                                for r in range(2)])
    assert all(isinstance(e, BackendError) for e in errors), errors
    assert "rank 1 sent 200 bytes at offset 0 of a 400 byte allreduce, rank 0 400" \
        in str(errors[0])


def test_only_two_ranks_can_pair():
    meshes = build(3)
    try:
        with pytest.raises(ValueError, match="needs 2 ranks, got rank 0 of 3"):
            PairExchange(meshes[0], 0)
    finally:
        for mesh in meshes:
            mesh.close()
