"""Payloads sent from resident buffers (hora_native/mesh_resident.py): read in
place by the peers, with no copy, and reduced by shares straight into every
rank's buffer.

Ranks are threads of this process over real sockets and real files in
/dev/shm, as in :mod:`test_mesh_round`. Every round must give every rank the
rank-order reduction of the prescaled contributions, bit for bit: when every
rank's payload is resident, when only some are (the others copied theirs:
/dev/shm full on one rank, or another tensor ready beside it), and when the
prescale cannot wait for the reduction (then nothing is resident).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from test_control_mesh import run_all
from test_mesh_round import _build, _Spec

from hora_native import ReduceKind
from hora_native.mesh import RESIDENT_MIN_BYTES, MeshBackend

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

NUMEL = RESIDENT_MIN_BYTES // 2 + 13  # past the threshold in every dtype, odd shares


def _values(rank: int, round_: int, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(NUMEL, dtype=torch.float64)
    return ((base * (rank + 1) + 3 * round_) % 97 - 40).to(dtype)


def _expected(values: list[torch.Tensor], prescale: float, op: ReduceKind) -> torch.Tensor:
    terms = [v.clone().mul_(prescale) if v.is_floating_point() else
             v.to(torch.float64).mul_(prescale).trunc_().to(v.dtype) for v in values]
    out = terms[0]
    for theirs in terms[1:]:
        out = {ReduceKind.SUM: torch.add, ReduceKind.MIN: torch.minimum,
               ReduceKind.MAX: torch.maximum, ReduceKind.PRODUCT: torch.mul}[op](out, theirs)
    return out


def _round(mesh: MeshBackend, tensor: torch.Tensor, prescale: float, op: ReduceKind,
           into_itself: bool) -> tuple[torch.Tensor, bool, frozenset[int]]:
    """One round on one rank with ``tensor`` alone ready: the result (written
    into the tensor itself, or into another), whether its payload was the
    tensor's own memory, and the ranks whose payloads were resident."""
    layout = mesh.layout([0], [_Spec(tensor)].__getitem__, mesh.budget, version=1)
    payload = mesh.pack([(0, tensor, prescale)], layout)
    assert payload is not None
    in_place = payload.data_ptr() == tensor.data_ptr()
    messages = mesh.exchange([1], payload)
    resident = mesh.transport.resident_ranks
    carried = mesh.round(messages, [layout.offsets] * mesh.size, lambda _slot: prescale)
    out = tensor if into_itself else torch.empty_like(tensor)
    carried.batch([(0, tensor.nbytes)]).allreduce(out, op)
    return out, in_place, resident


CASES = [(torch.float32, 1.0), (torch.float32, 0.5), (torch.float64, 0.25),
         (torch.float16, 0.5), (torch.int32, 1.0), (torch.int64, 0.5), (torch.float32, 0.3)]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("op", list(ReduceKind))
@pytest.mark.parametrize("dtype,prescale", CASES, ids=[f"{d}-{p}".removeprefix("torch.")
                                                       for d, p in CASES])
def test_resident_payloads_reduce_in_rank_order_on_every_rank(size, op, dtype, prescale,
                                                              shm_dir):
    meshes = _build(size, True, shm_dir)
    try:
        buffers = [mesh.transport.resident_zeros(NUMEL, dtype) for mesh in meshes]
        # A prescale the reduction may apply (1, or a power of two for floats).
        deferred = prescale == 1.0 or (dtype in (torch.float32, torch.float64)
                                       and prescale in (0.5, 0.25))
        for round_ in range(4):
            values = [_values(r, round_, dtype) for r in range(size)]
            for buffer, value in zip(buffers, values, strict=True):
                buffer.copy_(value)
            results, errors = run_all([
                lambda r=r, k=round_: _round(meshes[r], buffers[r], prescale, op,
                                             into_itself=k % 2 == 0) for r in range(size)])
            assert errors == [None] * size, errors
            expected = _expected(values, prescale, op)
            for rank, (out, in_place, resident) in enumerate(results):
                assert in_place == deferred, (rank, in_place)
                assert resident == (frozenset(range(size)) if deferred else frozenset())
                assert torch.equal(out, expected), (round_, rank)
                # Every rank's buffer holds the result where each rank reduced a
                # share into all of them (a product's prescale must scale each term).
                if deferred and (prescale == 1.0 or op is not ReduceKind.PRODUCT):
                    assert torch.equal(buffers[rank], expected), (round_, rank)
        # Every peer has opened each buffer: its file is gone, the memory is not.
        assert glob.glob(os.path.join(shm_dir, "*res*")) == [] or not deferred
    finally:
        for mesh in meshes:
            mesh.close()
    assert glob.glob(os.path.join(shm_dir, "*")) == []
    # The buffers outlive their meshes (an optimizer's gradients view them):
    # closing a mesh must not unmap them under the tensors.
    for buffer in buffers:
        buffer.add_(1)
        assert torch.isfinite(buffer.double()).all()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("op", [ReduceKind.SUM, ReduceKind.MAX, ReduceKind.PRODUCT])
def test_some_ranks_resident_and_others_copying_agree_bit_for_bit(size, op, shm_dir):
    """Rank 0's tensor lies in a resident buffer, the others' in private memory
    (their payloads are copies, prescaled as they go): every rank computes the
    whole reduction, scaling the resident contribution itself, and rank 0's
    buffer is written only after every rank has read it."""
    meshes = _build(size, True, shm_dir)
    try:
        tensors = [meshes[0].transport.resident_zeros(NUMEL, torch.float32)] + \
            [torch.zeros(NUMEL) for _ in range(1, size)]
        for round_ in range(4):
            values = [_values(r, round_, torch.float32) for r in range(size)]
            for tensor, value in zip(tensors, values, strict=True):
                tensor.copy_(value)
            results, errors = run_all([
                lambda r=r: _round(meshes[r], tensors[r], 0.5, op, into_itself=True)
                for r in range(size)])
            assert errors == [None] * size, errors
            expected = _expected(values, 0.5, op)
            for rank, (out, in_place, resident) in enumerate(results):
                assert in_place == (rank == 0) and resident == frozenset({0})
                assert torch.equal(out, expected), (round_, rank)
    finally:
        for mesh in meshes:
            mesh.close()


def test_a_tensor_beside_another_in_the_round_is_copied(shm_dir):
    """A resident tensor ready with another one is packed with it, as any tensor."""
    meshes = _build(2, True, shm_dir)
    try:
        resident = [mesh.transport.resident_zeros(NUMEL, torch.float32) for mesh in meshes]
        small = [torch.full((8,), float(r + 1)) for r in range(2)]

        def one(rank: int) -> list[torch.Tensor]:
            mesh = meshes[rank]
            tensors = [resident[rank], small[rank]]
            specs = [_Spec(t) for t in tensors]
            layout = mesh.layout([0, 1], specs.__getitem__, mesh.budget, version=1)
            payload = mesh.pack([(0, tensors[0], 0.5), (1, tensors[1], 0.5)], layout)
            assert payload is not None and payload.data_ptr() != tensors[0].data_ptr()
            carried = mesh.round(mesh.exchange([2], payload), [layout.offsets] * 2,
                                 lambda _slot: 0.5)
            assert mesh.transport.resident_ranks == frozenset()
            outs = [torch.empty_like(t) for t in tensors]
            carried.batch([(0, tensors[0].nbytes), (1, tensors[1].nbytes)]).allreduce(
                torch.cat([o.view(-1) for o in outs]), ReduceKind.SUM)
            return outs

        for rank in range(2):
            resident[rank].copy_(_values(rank, 0, torch.float32))
        _results, errors = run_all([lambda r=r: one(r) for r in range(2)])
        assert errors == [None, None], errors
    finally:
        for mesh in meshes:
            mesh.close()
