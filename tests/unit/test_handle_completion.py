"""A handle completes once: the first result or error wins, and its waiters and
callbacks are woken once (the engine's data plane may finish a tensor while the
generation's failure completes it)."""

from __future__ import annotations

import threading
import time

import pytest

from hora.engine.pending import Handle, Pending
from hora.errors import HorovodInternalError


def _counting(handle: Handle) -> list[Handle]:
    calls: list[Handle] = []
    handle.add_done_callback(calls.append)
    return calls


def test_an_error_first_keeps_the_error_and_a_later_result_is_ignored():
    handle = Handle("t")
    calls = _counting(handle)
    handle.set_error(HorovodInternalError("peer gone"))
    handle.set_result(41)
    Handle.set_results([handle], [42])
    assert handle.done() and len(calls) == 1
    with pytest.raises(HorovodInternalError, match="peer gone"):
        handle.wait(timeout=1)


def test_a_result_first_keeps_the_result_and_a_later_error_is_ignored():
    handle, other = Handle("t"), Handle("u")
    calls = _counting(handle)
    Handle.set_results([handle, other], [7, 8])
    handle.set_error(HorovodInternalError("too late"))
    assert handle.wait(timeout=1) == 7 and other.wait(timeout=1) == 8
    assert len(calls) == 1


def test_a_waiter_blocked_on_the_handle_is_woken_by_the_batch_that_completes_it():
    handle = Handle("t")
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(handle.wait(timeout=10)))
    waiter.start()
    deadline = time.monotonic() + 10
    while handle._event is None and waiter.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the waiter has made its event and blocks on it
    Handle.set_results([handle], [3])
    waiter.join(10)
    assert got == [3]


class _Held:
    """What Pending needs of an entry: a name and a handle."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.handle = Handle(name)


def test_a_failure_in_the_holding_thread_completes_what_it_took_out_of_the_table():
    pending = Pending(rank=0)
    taken, waiting, elsewhere = _Held("taken"), _Held("waiting"), _Held("elsewhere")
    with pending.lock:
        for entry in (taken, waiting, elsewhere):
            pending.add(entry)  # type: ignore[arg-type]
    # Another thread holds 'elsewhere' (inside its own data-plane call).
    other_took = threading.Event()
    release = threading.Event()

    def other() -> None:
        pending.holding()
        pending.take(["elsewhere"])
        other_took.set()
        release.wait(10)
        pending.release()

    thread = threading.Thread(target=other)
    thread.start()
    assert other_took.wait(10)
    assert pending.holding()
    assert not pending.holding()  # nested work records into the same list
    assert pending.take(["taken"]) == [taken]
    pending.fail(HorovodInternalError("data plane failed"))
    pending.release()
    assert taken.handle.done() and waiting.handle.done()
    # The other thread's tensor may still be written by its call: its own
    # run_safely fails it when that call ends, not this thread.
    assert not elsewhere.handle.done()
    release.set()
    thread.join(10)
    # Released: a later failure in this thread holds nothing any more.
    assert pending.take(["nothing"]) == []


def test_a_group_waits_out_every_tensor_before_its_first_error_and_its_timeout_is_the_groups():
    from hora.torch._submission import _Group

    failed, late = Handle("a"), Handle("b")
    failed.set_error(HorovodInternalError("rank 1 sent float64"))
    threading.Timer(0.2, late.set_result, (5,)).start()
    with pytest.raises(HorovodInternalError, match="float64"):
        _Group([failed, late]).wait(timeout=10)
    assert late.done()  # the error waited for the rest of the group

    # Tensors completing one after another, 0.2 s apart: each within 0.5 s of
    # the one before, the last after 2 s. The group's timeout of 0.5 s holds
    # for the whole group, not for each tensor in turn.
    staggered = [Handle(f"staggered.{i}") for i in range(10)]
    for i, handle in enumerate(staggered):
        threading.Timer(0.2 * (i + 1), handle.set_result, (i,)).start()
    with pytest.raises(TimeoutError):
        _Group(staggered).wait(timeout=0.5)
