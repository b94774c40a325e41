"""The mesh's payload round: layout, pack, exchange and the carried reduction.

Ranks are threads of this process over real loopback sockets (and real
segments in /dev/shm), as in :mod:`test_control_mesh`. Each round packs
tensors of several shapes and dtypes, exchanges them and reduces every
fused batch from the payloads; the result must be the rank-order reduction,
bit for bit, round after round (the payload alternates between two halves
of the segment, and the views of both are kept).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_control_mesh import TOKEN, run_all

from hora_native import PlacedViews, ReduceKind, RegionViews
from hora_native.mesh import KEPT_LAYOUTS, MeshBackend
from hora_native.mesh_segments import Segment

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


class _Spec:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.device = tensor.device.type
        self.nbytes = tensor.nbytes
        self.shape = tuple(tensor.shape)


def _build(size: int, shared: bool, shm_dir: str) -> list[MeshBackend]:
    store = dist.HashStore()
    prefix = os.path.join(shm_dir, "seg")
    meshes: list[MeshBackend | None] = [None] * size

    def make(rank: int) -> None:
        meshes[rank] = MeshBackend(store, rank, size, timedelta(seconds=20), "127.0.0.1",
                                   shared_memory=shared, shm_prefix=prefix, shm_bytes=1 << 22,
                                   socket_bytes=1 << 22, token=TOKEN, context="job/gen-1/")

    _, errors = run_all([lambda r=r: make(r) for r in range(size)])
    assert errors == [None] * size, errors
    return meshes  # type: ignore[return-value]


def _tensors(rank: int, round_: int, shapes: list[tuple[tuple[int, ...], torch.dtype]]
             ) -> list[torch.Tensor]:
    out = []
    for i, (shape, dtype) in enumerate(shapes):
        base = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        value = (base * (rank + 1) + 7 * i + 3 * round_) % 97 - 40
        out.append(value.to(dtype))
    return out


def _round(mesh: MeshBackend, tensors: list[torch.Tensor], prescale: list[float],
           op: ReduceKind, version: int = 1) -> list[torch.Tensor]:
    """One round on one rank: every tensor ready, each reduced alone from the payloads
    (``version``: the cache's, which changes with the tensors' signatures)."""
    slots = list(range(len(tensors)))
    specs = [_Spec(t) for t in tensors]
    layout = mesh.layout(slots, specs.__getitem__, mesh.budget, version=version)
    payload = mesh.pack([(s, t, p) for s, t, p in zip(slots, tensors, prescale, strict=True)],
                        layout)
    messages = mesh.exchange([len(slots)], payload)
    carried = mesh.round(messages, [layout.offsets] * mesh.size)
    out = []
    for slot, tensor in enumerate(tensors):
        result = torch.empty_like(tensor)
        carried.batch([(slot, tensor.nbytes)]).allreduce(result, op)
        out.append(result)
    return out


SHAPES_2D = [((64, 64), torch.float32), ((64,), torch.float32), ((3, 5, 2), torch.float64),
             ((7,), torch.int32), ((2, 3), torch.int64), ((5, 4), torch.float32)]
SHAPES_1D = [((256,), torch.float32)] * 5
SHAPES_ONE = [((1000,), torch.float32)]  # packed by one scaling kernel when prescaled


@pytest.mark.parametrize("shared", [False, True], ids=["sockets", "shared-memory"])
@pytest.mark.parametrize("shapes", [SHAPES_2D, SHAPES_1D, SHAPES_ONE],
                         ids=["mixed", "flat", "one"])
@pytest.mark.parametrize("op", [ReduceKind.SUM, ReduceKind.MIN, ReduceKind.MAX,
                                ReduceKind.PRODUCT])
@pytest.mark.parametrize("size", [2, 3])
def test_carried_rounds_reduce_in_rank_order_round_after_round(shared, shapes, op, size, shm_dir):
    meshes = _build(size, shared, shm_dir)
    try:
        for round_ in range(6):  # both halves of the segment, three times
            # No prescale; some tensors prescaled; all by one factor (an average's).
            prescale = [[1.0] * len(shapes),
                        [0.5 if i % 2 == 0 else 1.0 for i in range(len(shapes))],
                        [0.25] * len(shapes)][round_ % 3]
            inputs = [_tensors(r, round_, shapes) for r in range(size)]
            originals = [[t.clone() for t in ts] for ts in inputs]
            results, errors = run_all([
                lambda r=r, p=prescale, i=inputs: _round(meshes[r], i[r], p, op)
                for r in range(size)])
            assert errors == [None] * size, errors
            for i, (_shape, dtype) in enumerate(shapes):
                expected = None
                for r in range(size):
                    theirs = originals[r][i].clone()
                    if prescale[i] != 1.0:
                        theirs = theirs.mul_(prescale[i]) if theirs.is_floating_point() else \
                            theirs.to(torch.float64).mul_(prescale[i]).trunc_().to(dtype)
                    if expected is None:
                        expected = theirs
                    elif op is ReduceKind.SUM:
                        expected = expected + theirs
                    elif op is ReduceKind.MIN:
                        expected = torch.minimum(expected, theirs)
                    elif op is ReduceKind.MAX:
                        expected = torch.maximum(expected, theirs)
                    else:
                        expected = expected * theirs
                for r in range(size):
                    got = results[r][i]
                    assert got.dtype == dtype and got.shape == originals[r][i].shape
                    assert torch.equal(got, expected), (round_, i, r)
                    # Packing never writes the caller's tensor.
                    assert torch.equal(inputs[r][i], originals[r][i])
    finally:
        for mesh in meshes:
            mesh.close()


@pytest.mark.parametrize("shared", [False, True], ids=["sockets", "shared-memory"])
def test_kept_views_go_when_the_transport_replaces_a_payload_buffer(shared, shm_dir):
    """A payload larger than the buffers so far replaces them (a segment grows,
    ours and the peer's); the views kept of the old ones go with it, and the
    rounds stay exact."""
    meshes = _build(2, shared, shm_dir)
    try:
        versions = [mesh.transport.buffers_version for mesh in meshes]
        for numel in (1000, 1000, 600_000, 600_000):  # 4 KB, then 2.4 MB (past 1 MiB)
            inputs = [[torch.full((numel,), float(r + 1))] for r in range(2)]
            results, errors = run_all([lambda r=r, i=inputs, v=numel: _round(
                meshes[r], i[r], [1.0], ReduceKind.SUM, version=v) for r in range(2)])
            assert errors == [None, None], errors
            assert all(torch.equal(out[0], torch.full((numel,), 3.0)) for out in results)
        for rank, mesh in enumerate(meshes):
            assert mesh.transport.buffers_version > versions[rank]
            live = {view.untyped_storage().data_ptr()
                    for view in [*mesh._regions._views.values(),
                                 *(v for views in mesh._placed._views.values() for v in views)]}
            current = {buf.untyped_storage().data_ptr() for buf in _payload_buffers(mesh)}
            assert live and live <= current, (rank, live, current)
    finally:
        for mesh in meshes:
            mesh.close()


def _payload_buffers(mesh: MeshBackend) -> list[torch.Tensor]:
    """The buffers a mesh's payloads lie in now: its own and its peers'."""
    transport = mesh.transport
    if transport.shared:
        assert transport._segment is not None
        return [transport._segment.tensor,
                *(segment.tensor for _version, segment in transport._peer_segments.values())]
    assert transport._send is not None
    return [transport._send, *transport._buffers.values()]


def test_a_mesh_keeps_a_bounded_number_of_layouts(shm_dir):
    meshes = _build(2, False, shm_dir)
    try:
        spec = _Spec(torch.zeros(4))
        mesh = meshes[0]
        first = mesh.layout([0, 1], lambda _slot: spec, 1 << 20, version=1)
        for n in range(3 * KEPT_LAYOUTS):  # a different set of ready slots each round
            mesh.layout(list(range(n % 7, n % 7 + 2 + n)), lambda _slot: spec, 1 << 20,
                        version=1)
        assert len(mesh._layouts) <= KEPT_LAYOUTS
        again = mesh.layout([0, 1], lambda _slot: spec, 1 << 20, version=1)
        assert (again.offsets, again.total, again.flat) == (first.offsets, first.total,
                                                            first.flat)
    finally:
        for mesh in meshes:
            mesh.close()


def test_placed_views_are_kept_per_layout_and_the_oldest_goes_first():
    buf = torch.zeros(64, dtype=torch.uint8)
    placed = PlacedViews(keep=2)
    layout = [(0, torch.float32, torch.Size([2, 2])), (16, torch.int64, torch.Size([3]))]
    like = [torch.ones(2, 2), torch.ones(3, dtype=torch.int64)]
    views = placed.get(buf, tuple(layout), lambda: (layout, like))
    assert [v.shape for v in views] == [torch.Size([2, 2]), torch.Size([3])]
    views[0].fill_(1.5)
    views[1].copy_(torch.tensor([1, -2, 3]))
    assert torch.equal(buf[:16].view(torch.float32), torch.full((4,), 1.5))
    assert torch.equal(buf[16:40].view(torch.int64), torch.tensor([1, -2, 3]))
    assert placed.get(buf, tuple(layout), lambda: pytest.fail("made again")) is views  # the same layout: the same views
    placed.get(buf, "a", lambda: (layout[:1], like[:1]))
    placed.get(buf, "b", lambda: (layout[1:], like[1:]))  # a third layout: the first goes
    assert placed.get(buf, tuple(layout), lambda: (layout, like)) is not views
    again = placed.get(buf, tuple(layout), lambda: (layout, like))
    placed.clear()
    assert placed.get(buf, tuple(layout), lambda: (layout, like)) is not again
    assert placed.get(buf[8:], tuple(layout), lambda: (layout, like)) is not again


def test_region_views_are_views_of_the_bytes_kept_by_address_length_and_dtype():
    buf = torch.zeros(64, dtype=torch.uint8)
    regions = RegionViews(keep=3)
    floats = regions.get(buf, 8, 16, torch.float32)
    assert floats.shape == (4,) and floats.data_ptr() == buf.data_ptr() + 8
    floats.fill_(2.5)
    assert torch.equal(buf[8:24].view(torch.float32), torch.full((4,), 2.5))
    assert regions.get(buf, 8, 16, torch.float32) is floats
    # The same address from another view of the buffer: the same bytes, the same view.
    assert regions.get(buf[8:], 0, 16, torch.float32) is floats
    assert regions.get(buf, 8, 16, torch.int32) is not floats  # another dtype
    assert regions.get(buf, 8, 8, torch.float32).shape == (2,)  # another length
    other = torch.zeros(64, dtype=torch.uint8)
    assert regions.get(other, 8, 16, torch.float32).data_ptr() == other.data_ptr() + 8
    # Full (keep=3): every kept view went, and a new one is made.
    assert regions.get(buf, 8, 16, torch.float32) is not floats


def test_a_segments_regions_are_kept_and_dropped_when_it_closes(tmp_path):
    segment = Segment(str(tmp_path / "seg"), 4096, create=True)
    region = segment.region(2048, 100)
    assert region.numel() == 100 and region.data_ptr() == segment.tensor.data_ptr() + 2048
    assert segment.region(2048, 100) is region
    assert segment.region(0, 100) is not region
    region.fill_(7)
    reader = Segment(str(tmp_path / "seg"), 0, create=False)
    assert reader.region(2048, 100).tolist() == [7] * 100
    segment.close()
    reader.close()
    assert not segment._regions._views and not reader._regions._views


def test_placed_views_of_runs_with_empty_tensors_and_a_dtype_change():
    buf = torch.zeros(80, dtype=torch.uint8)
    like = [torch.ones(2, 3), torch.ones(0, 4), torch.ones(2), torch.ones(3, dtype=torch.int64)]
    layout = [(0, torch.float32, like[0].shape), (24, torch.float32, like[1].shape),
              (24, torch.float32, like[2].shape), (40, torch.int64, like[3].shape)]
    views = PlacedViews().get(buf, 0, lambda: (layout, like))
    assert [v.shape for v in views] == [t.shape for t in like]
    torch._foreach_copy_(views, [torch.full((2, 3), 2.0), torch.ones(0, 4),
                                 torch.tensor([3.0, 4.0]), torch.tensor([5, 6, 7])])
    assert buf[:32].view(torch.float32).tolist() == [2.0] * 6 + [3.0, 4.0]
    assert buf[40:64].view(torch.int64).tolist() == [5, 6, 7]


def test_a_layout_is_flat_only_for_1d_tensors_of_one_dtype(shm_dir):
    meshes = _build(2, False, shm_dir)
    try:
        mesh = meshes[0]
        versions = iter(range(1, 100))  # a new cache version each: no kept layout

        def flat(*tensors: torch.Tensor) -> tuple[int, int] | None:
            specs = [_Spec(t) for t in tensors]
            return mesh.layout(range(len(specs)), specs.__getitem__, 1 << 20,
                               version=next(versions)).flat

        assert flat(torch.zeros(3), torch.zeros(5)) == (0, 32)
        assert flat(torch.zeros(3), torch.zeros(2, 2)) is None
        assert flat(torch.zeros(3), torch.zeros(5, dtype=torch.float64)) is None
        assert mesh.layout([0], lambda _slot: _Spec(torch.zeros(3)), 0, version=1).flat is None
    finally:
        for mesh in meshes:
            mesh.close()
