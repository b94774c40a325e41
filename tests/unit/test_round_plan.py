"""The agreement's round as plan and execution.

:func:`hora.engine.plan.plan_round` is pure: its tests hand it agreed vectors.
The round tests run N ranks' engines (pending table, executor, agreement) as
threads of this process, over real Gloo; their control vectors go through a
lock-step fake :class:`~hora.engine.transport.ControlTransport`, and the test
plays the coordinator (it answers with response lists).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_control_mesh import build, run_all

from hora._ops import OpType
from hora.engine.agreement import Agreement
from hora.engine.cache import ResponseCache
from hora.engine.control import INVALID, NOT_READY, READY, ControlVector
from hora.engine.executor import Executor, TimelineRef
from hora.engine.pending import Entry, Handle, Pending
from hora.engine.plan import BackendSelector, Path, plan_round
from hora.engine.process_sets import ProcessSets
from hora.engine.transport import Carried, GlooControl
from hora.errors import HorovodInternalError
from hora.settings import Settings
from hora_native import BackendError
from hora_native.mesh import PairwiseAllreduce
from hora_proto.v1 import negotiation_pb2 as npb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

WAIT_S = 30.0  # the deadline of every blocking call below


def _entry(name: str, numel: int = 4, value: float = 1.0, dtype: torch.dtype = torch.float32
           ) -> Entry:
    return Entry(name=name, op_type=OpType.ALLREDUCE,
                 buffer=torch.full((numel,), value, dtype=dtype), handle=Handle(name))


def _agreed(*vectors: ControlVector) -> ControlVector:
    return ControlVector.decode(ControlVector.agree([v.encode() for v in vectors]))


def _vector(slots: list[int], received: int = 0, usable: bool = True, threshold_kib: int = 64
            ) -> ControlVector:
    return ControlVector.of(slots, received, usable, fusion_threshold_kib=threshold_kib,
                            cycle_us=0, payload_budget=0)


def _cache(*entries: Entry) -> ResponseCache:
    cache = ResponseCache(16)
    for entry in entries:
        cache.put(entry.name, entry.signature())
    return cache


# ---- control vectors -----------------------------------------------------------------------


def test_sparse_vectors_agree_as_the_element_wise_min_of_dense_ones():
    """The vectors list ready and invalid slots only; agreeing them gives what the
    element-wise MIN of one value per slot gives (INVALID < NOT_READY < READY),
    fields included, for any mix of ranks, widths and values."""
    rng = random.Random(28)
    values = [INVALID, NOT_READY, READY]
    for trial in range(300):
        ranks, width = rng.randint(1, 4), rng.choice([0, 1, 2, 5, 40])
        # Half the trials: every rank ready with the same slots, as in training.
        same = [rng.choice(values[1:]) for _ in range(width)]
        dense = [same if trial % 2 else [rng.choices(values, (1, 4, 4))[0]
                                         for _ in range(width)] for _ in range(ranks)]
        fields = [[rng.randint(-5, 5) for _ in range(7)] for _ in range(ranks)]
        vectors = [ControlVector.of(slots, f[0], bool(f[1] % 2), fusion_threshold_kib=f[2],
                                    cycle_us=f[3], payload_budget=f[4], wait_us=f[5],
                                    minus_wait_us=f[6])
                   for slots, f in zip(dense, fields, strict=True)]
        agreed = ControlVector.decode(ControlVector.agree([v.encode() for v in vectors]))
        assert agreed.slots == [min(column) for column in zip(*dense, strict=True)] \
            if width else agreed.slots == []
        assert agreed.width == width
        assert agreed.ready == sorted(agreed.ready) and agreed.invalid == sorted(agreed.invalid)
        assert [agreed.lists_received, agreed.fusion_threshold_kib, agreed.cycle_us,
                agreed.payload_budget, agreed.wait_us, agreed.minus_wait_us] == \
            [min(f[i] for f in fields) for i in (0, 2, 3, 4, 5, 6)]
        assert agreed.cache_usable == all(f[1] % 2 for f in fields)


def test_a_round_sends_its_ready_and_invalid_slots_not_the_whole_cache():
    vector = ControlVector.of([NOT_READY] * 398 + [READY, INVALID], 3, True)
    assert (vector.width, vector.ready, vector.invalid) == (400, [398], [399])
    assert len(vector.encode()) == ControlVector._HEAD + 2
    assert ControlVector.decode(vector.encode()) == vector


def test_vectors_of_caches_of_different_sizes_are_an_error_not_a_wrong_answer():
    vectors = [ControlVector.of([READY, READY], 0, True).encode(),
               ControlVector.of([READY], 0, True).encode()]
    with pytest.raises(BackendError, match="rank 1 has 1 cache slots, rank 0 2; the ranks' "
                                           "caches diverged"):
        ControlVector.agree(vectors)


# ---- plan_round (pure) -------------------------------------------------------------------


def test_the_plan_evicts_invalid_slots_and_resends_what_waits_in_them():
    x, y = _entry("x"), _entry("y")
    cache = _cache(x, y)
    cached = {0: x, 1: y}
    agreed = _agreed(_vector([READY, READY]), _vector([READY, INVALID]))
    plan = plan_round(agreed, cached, cache.signature, None, pairwise=None, cache_on=True,
                      executed=0)
    assert plan.evictions == (1,)
    assert plan.resends == (y,)
    assert [item[2] for item in plan.ready] == [x]
    assert [[item[2] for item in batch.items] for batch in plan.batches] == [[x]]
    assert not plan.cache_off and plan.lists == 0
    assert cached == {0: x, 1: y}, "planning changed its input"


def test_only_slots_ready_on_every_rank_run():
    a, b, c = _entry("a"), _entry("b"), _entry("c")
    cache = _cache(a, b, c)
    # Rank 0 waits in a and b, rank 1 in b and c, rank 2 in b only.
    agreed = _agreed(_vector([READY, READY, NOT_READY]), _vector([NOT_READY, READY, READY]),
                     _vector([NOT_READY, READY, NOT_READY]))
    plan = plan_round(agreed, {0: a, 1: b}, cache.signature, None, pairwise=None,
                      cache_on=True, executed=0)
    assert [item[0] for item in plan.ready] == [1]
    assert plan.evictions == () and plan.resends == ()


def test_a_joined_rank_turns_the_cache_off_and_lists_every_rank_has_run():
    x = _entry("x")
    cache = _cache(x)
    agreed = _agreed(_vector([READY], received=3), _vector([NOT_READY], received=2,
                                                           usable=False))
    plan = plan_round(agreed, {0: x}, cache.signature, None, pairwise=None, cache_on=True,
                      executed=1)
    assert plan.cache_off and plan.lists == 1 and plan.ready == []
    off = plan_round(agreed, {0: x}, cache.signature, None, pairwise=None, cache_on=False,
                     executed=2)
    assert not off.cache_off and off.lists == 0


def test_carried_tensors_go_first_in_one_batch_the_rest_fuse_up_to_the_threshold():
    entries = [_entry(f"t{i}", numel=256) for i in range(5)]  # 1 KiB each
    cache = _cache(*entries)
    agreed = _agreed(_vector([READY] * 5, threshold_kib=2))
    carried = {0, 2, 4}
    plan = plan_round(agreed, dict(enumerate(entries)), cache.signature, carried.__contains__,
                      pairwise=None, cache_on=True, executed=0)
    assert [(b.path, [item[0] for item in b.items]) for b in plan.batches] == [
        (Path.CARRIED, [0, 2, 4]), (Path.SET, [1, 3])]
    double = _entry("d", numel=256, dtype=torch.float64)  # another fusion key
    cache.put("d", double.signature())
    agreed = _agreed(_vector([READY] * 6, threshold_kib=1))
    plan = plan_round(agreed, {**dict(enumerate(entries)), 5: double}, cache.signature, None,
                      pairwise=PairwiseAllreduce.takes, cache_on=True, executed=0)
    assert [[item[0] for item in b.items] for b in plan.batches] == [[0], [1], [2], [3], [4],
                                                                      [5]]
    assert {b.path for b in plan.batches} == {Path.PAIRWISE}


def test_the_cached_and_the_negotiated_paths_pick_the_same_backend():
    """One CPU tensor at 2 ranks of several machines: the pairwise mesh on both paths
    while the agreed payload budget is above 0, the set's Gloo on both at 0."""
    meshes = build(2)
    store = dist.HashStore()
    try:
        pairs = [PairwiseAllreduce(mesh, rank) for rank, mesh in enumerate(meshes)]
        sets = [ProcessSets(rank, 2, dist.PrefixStore("w/", store), timedelta(seconds=WAIT_S),
                            "127.0.0.1", run_list=lambda _batch: None) for rank in range(2)]
        run_all([lambda s=s: s.backend("cpu", s.get(0)) for s in sets])
        selector = BackendSelector(sets[0], pairs[0])
        x = _entry("x")
        cache = _cache(x)
        group = sets[0].get(0)
        for budget, expected in ((4096, pairs[0]), (0, sets[0].backend("cpu", group))):
            selector.agree(budget)
            plan = plan_round(_agreed(_vector([READY])), {0: x}, cache.signature, None,
                              pairwise=selector.pairwise_takes, cache_on=True, executed=0)
            (batch,) = plan.batches
            cached = selector.reducer(batch.path, "cpu", group)
            negotiated = selector.for_entries([x], group)
            assert cached is negotiated is expected, (budget, cached, negotiated)
    finally:
        for mesh in meshes:
            mesh.close()
        for s in sets:
            s.close()


def test_a_quick_key_stands_for_a_signature_only_while_the_slot_keeps_it():
    x = _entry("x")
    assert x.quick_key() == _entry("x", value=5.0).quick_key()  # another tensor, same kind
    for other in (_entry("x", numel=5), _entry("x", dtype=torch.float64)):
        assert other.quick_key() != x.quick_key() and other.signature() != x.signature()
    cache = _cache(x)
    slot, _ = cache.lookup("x")
    assert cache.quick(slot) is None
    cache.record_quick(slot, x.quick_key())
    assert cache.quick(slot) == x.quick_key()
    cache.put("x", _entry("x", numel=5).signature())  # the slot's signature changes
    assert cache.quick(slot) is None
    cache.record_quick(slot, x.quick_key())
    cache.evict(slot)
    slot_again, _ = cache.put("y", _entry("y").signature())
    assert slot_again == slot and cache.quick(slot) is None


# ---- rounds of N ranks in one process -----------------------------------------------------


class LockStep:
    """The ranks' meeting point: each round, every rank's vector, then the MIN."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=WAIT_S)
        self.vectors: list[list[int]] = [[] for _ in range(size)]
        self.fail_on: int | None = None  # a rank whose exchange breaks the round
        self.exchanges = 0


class FakeControl:
    """A :class:`ControlTransport` over :class:`LockStep`: no payloads."""

    budget = 0
    waiting_for: tuple[int, ...] = ()

    def __init__(self, world: LockStep, rank: int) -> None:
        self._world = world
        self._rank = rank
        self.last_vectors: list[list[int]] = []

    def exchange(self, vector: ControlVector, ready: Sequence[tuple[int, Entry]],
                 budget: int, *, spin: bool = False) -> tuple[ControlVector, Carried | None]:
        world = self._world
        if world.fail_on == self._rank:
            world.barrier.abort()
            raise BackendError(f"rank {self._rank}: connection to rank 1 reset")
        world.vectors[self._rank] = vector.encode()
        try:
            world.barrier.wait()
            vectors = list(world.vectors)
            if self._rank == 0:
                world.exchanges += 1
            world.barrier.wait()  # all have read before the next round writes
        except threading.BrokenBarrierError:
            raise BackendError("a peer broke the round") from None
        self.last_vectors = vectors
        return ControlVector.decode(ControlVector.agree(vectors)), None


class Rank:
    """One rank's engine stages, wired as the facade wires them (no coordinator)."""

    def __init__(self, world: LockStep, rank: int, store: dist.Store) -> None:
        self.rank = rank
        self.pending = Pending(rank)
        self.sets = ProcessSets(rank, world.size, store, timedelta(seconds=WAIT_S),
                                "127.0.0.1", run_list=lambda _batch: None)
        selector = BackendSelector(self.sets, None)
        timeline = TimelineRef()
        self.executor = Executor(rank, self.pending, self.sets, selector, timeline)
        self.sent: list[npb.TensorRequest] = []
        self.agreement = Agreement(Settings.from_env({}), rank, world.size, self.pending,
                                   self.executor, send=self.sent.append,
                                   control=lambda _cache: FakeControl(world, rank),
                                   selector=selector, timeline=timeline)
        self.pending.on_fail.append(self.agreement.drop_all)

    def enqueue(self, entry: Entry) -> Handle:
        with self.pending.lock:
            self.pending.add(entry)
            entry.handle.driver = self.agreement.drive
            if self.agreement.admit(entry):
                return entry.handle
        self.sent.append(entry.request())
        return entry.handle


@pytest.fixture
def ranks() -> Iterator[Callable[[int], list[Rank]]]:
    made: list[Rank] = []

    def make(size: int) -> list[Rank]:
        world, store = LockStep(size), dist.HashStore()
        ranks = [Rank(world, rank, store) for rank in range(size)]
        run_all([lambda r=r: r.sets.backend("cpu", r.sets.get(0)) for r in ranks])
        made.extend(ranks)
        return ranks

    yield make
    for rank in made:
        rank.pending.stopping.set()
        rank.sets.close()


def _answer(ranks: list[Rank], *responses: npb.Response) -> None:
    """The coordinator's list, to every rank."""
    for rank in ranks:
        rank.agreement.receive_list(list(responses))


def _allreduce(*names: str) -> npb.Response:
    return npb.Response(type=npb.RESPONSE_TYPE_ALLREDUCE, tensor_names=list(names))


def _wait_all(handles: list[Handle]) -> list:
    """Every handle's result, waited for in threads at once (each drives rounds)."""
    results, errors = run_all([lambda h=h: h.wait(WAIT_S) for h in handles])
    assert not any(errors), errors
    return results


def test_large_worlds_agree_through_gloo_as_the_mesh_would(ranks):
    """Above the mesh's size the vectors go dense through a Gloo MIN-allreduce:
    every rank gets what agreeing the sparse vectors gives."""
    world = ranks(3)
    dense = [[READY, READY, NOT_READY, READY], [READY, INVALID, READY, READY],
             [READY, READY, READY, NOT_READY]]
    vectors = [ControlVector.of(slots, 5 - r, r != 1, fusion_threshold_kib=64 + r,
                                cycle_us=10 - r, payload_budget=7, wait_us=100 * r,
                                minus_wait_us=-100 * r)
               for r, slots in enumerate(dense)]
    results, errors = run_all([lambda r=r: GlooControl(world[r].sets).exchange(vectors[r], [], 0)
                               for r in range(3)])
    assert errors == [None] * 3
    want = ControlVector.decode(ControlVector.agree([v.encode() for v in vectors]))
    assert want.ready == [0] and want.invalid == [1]
    assert all(result == (want, None) for result in results)


def test_a_negotiated_allreduce_is_cached_and_then_agreed_peer_to_peer(ranks):
    world = ranks(3)
    handles = [r.enqueue(_entry("x", value=r.rank + 1)) for r in world]
    _answer(world, _allreduce("x"))
    assert [t.tolist() for t in _wait_all(handles)] == [[6.0] * 4] * 3
    assert all([req.name for req in r.sent] == ["x"] for r in world)
    handles = [r.enqueue(_entry("x", value=r.rank * 2)) for r in world]
    assert [t.tolist() for t in _wait_all(handles)] == [[6.0] * 4] * 3
    assert all(len(r.sent) == 1 for r in world), "the cached allreduce went to the coordinator"


def test_a_tensor_ready_on_some_ranks_only_waits_for_the_others(ranks):
    world = ranks(3)
    for name in ("y", "z"):
        handles = [r.enqueue(_entry(name)) for r in world]
        _answer(world, _allreduce(name))
        _wait_all(handles)
    # Ranks 0 and 1 are ready with y, rank 2 with z: rounds run, neither completes.
    ys = [r.enqueue(_entry("y", value=1.0)) for r in world[:2]]
    z2 = world[2].enqueue(_entry("z", value=5.0))
    threads = [threading.Thread(target=h.wait, args=(WAIT_S,)) for h in ys + [z2]]
    for thread in threads:
        thread.start()
    before = world[0].agreement.rounds
    for _ in range(200):
        if world[0].agreement.rounds >= before + 3:
            break
        threading.Event().wait(0.05)
    assert world[0].agreement.rounds >= before + 3, "no rounds ran"
    assert not any(h.done() for h in ys + [z2])
    y2 = world[2].enqueue(_entry("y", value=3.0))
    zs = [r.enqueue(_entry("z", value=1.0)) for r in world[:2]]
    results = _wait_all(ys + [y2] + zs + [z2])
    for thread in threads:
        thread.join(WAIT_S)
    assert [t.tolist() for t in results] == [[5.0] * 4] * 3 + [[7.0] * 4] * 3
    assert all(len(r.sent) == 2 for r in world), "a cached tensor went to the coordinator"


def test_a_join_turns_the_cache_off_and_the_waiting_tensors_go_to_the_coordinator(ranks):
    world = ranks(3)
    handles = [r.enqueue(_entry("x")) for r in world]
    _answer(world, _allreduce("x"))
    _wait_all(handles)
    xs = [r.enqueue(_entry("x", value=2.0)) for r in world[:2]]
    join = world[2].enqueue(Entry(name="join.0", op_type=OpType.JOIN,
                                  buffer=torch.zeros(1), handle=Handle("join.0")))
    assert world[2].sent[-1].name == "join.0"
    waiters = [threading.Thread(target=h.wait, args=(WAIT_S,)) for h in xs + [join]]
    for thread in waiters:
        thread.start()
    for _ in range(200):
        if (all(len(r.sent) == 2 for r in world[:2])
                and all(r.agreement.cache.lookup("x") is None for r in world)):
            break
        threading.Event().wait(0.05)
    assert [[req.name for req in r.sent] for r in world[:2]] == [["x", "x"]] * 2
    assert all(r.agreement.cache.lookup("x") is None for r in world)
    # The coordinator: x with a stand-in for the joined rank, then the join.
    x = world[0].sent[-1]
    fill = npb.TensorRequest()
    fill.CopyFrom(x)
    _answer(world, npb.Response(type=npb.RESPONSE_TYPE_ALLREDUCE, tensor_names=["x"],
                                join_fill=[fill]),
            npb.Response(type=npb.RESPONSE_TYPE_JOIN, tensor_names=["join.0"],
                         last_joined_rank=2))
    results = _wait_all(xs + [join])
    for thread in waiters:
        thread.join(WAIT_S)
    assert [t.tolist() for t in results[:2]] == [[4.0] * 4] * 2
    assert results[2] == 2


def test_a_failing_peer_fails_every_pending_handle_with_the_error(ranks):
    world = ranks(3)
    handles = [r.enqueue(_entry("x")) for r in world]
    _answer(world, _allreduce("x"))
    _wait_all(handles)
    lockstep = world[0].agreement._control._world  # type: ignore[attr-defined]
    lockstep.fail_on = 1
    cached = [r.enqueue(_entry("x")) for r in world]
    others = [r.enqueue(_entry("w")) for r in world]  # waiting for the coordinator
    errors = _wait_all_errors(cached) + [_error_of(h) for h in others]
    assert all(isinstance(e, HorovodInternalError) for e in errors), errors
    assert "connection to rank 1 reset" in str(errors[1])
    assert all("data plane failed on rank" in str(e) for e in errors), errors
    assert all(r.pending.failure is not None for r in world)


def _wait_all_errors(handles: list[Handle]) -> list:
    results, errors = run_all([lambda h=h: _error_of(h) for h in handles])
    assert not any(errors), errors
    return results


def _error_of(handle: Handle) -> BaseException | None:
    try:
        handle.wait(WAIT_S)
    except HorovodInternalError as exc:
        return exc
    return None



def test_a_cached_signatures_fusion_fields_fuse_as_the_coordinators_fusion_key():
    from hora.engine.cache import Signature, fusion_fields
    from hora_proto.tensors import fusion_key

    base = Signature("float32", (4, 4), "cpu", 1, 1.0, 0.5)
    variants = [base, base._replace(shape=(7,)), base._replace(dtype="float16"),
                base._replace(device="cuda"), base._replace(reduce_op=3),
                base._replace(prescale_factor=2.0), base._replace(postscale_factor=1.0)]
    for a in variants:
        for b in variants:
            same_key = fusion_key(a.dtype, a.device, a.reduce_op, a.prescale_factor,
                                  a.postscale_factor) == \
                fusion_key(b.dtype, b.device, b.reduce_op, b.prescale_factor, b.postscale_factor)
            assert (fusion_fields(a) == fusion_fields(b)) == same_key, (a, b)
