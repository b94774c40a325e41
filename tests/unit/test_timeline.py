"""The timeline writer: Horovod's event names, balanced rows, valid JSON even after kill -9."""

from __future__ import annotations

import enum
import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import pytest

from hora.timeline import NULL_TIMELINE, NullTimeline, Timeline, row_name

pytestmark = pytest.mark.timeout(60)

FAST = timedelta(milliseconds=1)


def load(path: Path) -> list[dict]:
    with open(path) as f:
        events = json.load(f)
    assert isinstance(events, list)
    return events


def row_names(events: list[dict]) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def rows(events: list[dict]) -> dict[str, list[tuple[str, str]]]:
    """(phase, name) of the B/E events of each tensor row, in file order."""
    names = row_names(events)
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for e in events:
        if e["ph"] in "BE":
            out[names[(e["pid"], e["tid"])]].append((e["ph"], e["name"]))
    return out


def assert_balanced(events: list[dict]) -> None:
    """Every row's B/E events nest like brackets, in time order, after its name."""
    named: set[tuple[int, int]] = set()
    stacks: dict[tuple[int, int], list[str]] = defaultdict(list)
    last: dict[tuple[int, int], float] = {}
    for e in events:
        key = (e["pid"], e["tid"])
        if e["ph"] == "M" and e["name"] == "thread_name":
            named.add(key)
        if e["ph"] not in "BE":
            continue
        assert key in named, f"row {key} has events before its thread_name"
        assert e["ts"] >= last.get(key, 0.0), e
        last[key] = e["ts"]
        if e["ph"] == "B":
            stacks[key].append(e["name"])
        else:
            assert stacks[key], f"E without B on row {key}: {e}"
            assert stacks[key].pop() == e["name"], e
    assert not any(stacks.values()), dict(stacks)


def one_allreduce(tl: Timeline | NullTimeline, name: str) -> None:
    tl.negotiate_start(name, "ALLREDUCE")
    tl.negotiate_end(name)
    tl.start(name, "ALLREDUCE")
    tl.activity_start(name, "QUEUE")
    tl.activity_end(name)
    tl.activity_start(name, "MEMCPY_IN_FUSION_BUFFER")
    tl.activity_end(name)
    tl.activity_start(name, "GLOO_ALLREDUCE")
    tl.activity_end(name)
    tl.activity_start(name, "MEMCPY_OUT_FUSION_BUFFER")
    tl.activity_end(name)
    tl.end(name)


@pytest.mark.unit
def test_events_use_horovods_names_and_nest_per_tensor_row(tmp_path):
    path = tmp_path / "timeline.json"
    with Timeline(path, rank=3) as tl:
        one_allreduce(tl, "grad.weight")
        tl.negotiate_start("gathered", "ALLGATHER")
        tl.negotiate_end("gathered")
        tl.start("gathered", "ALLGATHER")
        tl.activity_start("gathered", "GLOO_ALLGATHER")
        tl.activity_end("gathered")
        tl.end("gathered")
    events = load(path)
    assert_balanced(events)
    assert {e["pid"] for e in events} == {3}
    process = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert process == [
        {"name": "process_name", "ph": "M", "pid": 3, "tid": 0, "args": {"name": "rank 3"}}
    ]
    # Horovod's row names: the collective, then the tensor's name.
    assert sorted(row_names(events).values()) == ["allgather.gathered", "allreduce.grad.weight"]
    by_row = rows(events)
    assert by_row["allreduce.grad.weight"] == [
        ("B", "NEGOTIATE_ALLREDUCE"), ("E", "NEGOTIATE_ALLREDUCE"),
        ("B", "ALLREDUCE"),
        ("B", "QUEUE"), ("E", "QUEUE"),
        ("B", "MEMCPY_IN_FUSION_BUFFER"), ("E", "MEMCPY_IN_FUSION_BUFFER"),
        ("B", "GLOO_ALLREDUCE"), ("E", "GLOO_ALLREDUCE"),
        ("B", "MEMCPY_OUT_FUSION_BUFFER"), ("E", "MEMCPY_OUT_FUSION_BUFFER"),
        ("E", "ALLREDUCE"),
    ]  # fmt: skip
    assert by_row["allgather.gathered"] == [
        ("B", "NEGOTIATE_ALLGATHER"), ("E", "NEGOTIATE_ALLGATHER"),
        ("B", "ALLGATHER"), ("B", "GLOO_ALLGATHER"), ("E", "GLOO_ALLGATHER"),
        ("E", "ALLGATHER"),
    ]  # fmt: skip
    timed = [e for e in events if e["ph"] in "BE"]
    assert all(isinstance(e["ts"], float) and e["ts"] >= 0 for e in timed)


@pytest.mark.unit
def test_every_op_has_its_negotiate_and_top_level_names(tmp_path):
    class Op(enum.IntEnum):  # like hora._ops.OpType, without importing torch
        BROADCAST = 3
        JOIN = 7

    ops = ["ALLREDUCE", "ALLGATHER", Op.BROADCAST, "ALLTOALL", "REDUCESCATTER", "BARRIER", Op.JOIN]
    path = tmp_path / "t.json"
    with Timeline(path, rank=0) as tl:
        for op in ops:
            name = getattr(op, "name", op).lower()
            tl.negotiate_start(name, op)
            tl.negotiate_end(name)
            tl.start(name, op)
            tl.end(name)
    by_row = rows(load(path))
    for op in ops:
        op = getattr(op, "name", op)
        assert by_row[f"{op.lower()}.{op.lower()}"] == [
            ("B", f"NEGOTIATE_{op}"),
            ("E", f"NEGOTIATE_{op}"),
            ("B", op),
            ("E", op),
        ]


@pytest.mark.unit
def test_rows_carry_horovods_tensor_names(tmp_path):
    # Horovod's torch layer names a tensor <collective>.<name> (grouped ones
    # grouped_<collective>.<name>_<i>of<n>); hora's own generated names and the
    # optimizer's allreduce.<parameter> already have that form and stay.
    assert row_name("fc.weight", "ALLREDUCE") == "allreduce.fc.weight"
    assert row_name("allreduce.fc.weight", "ALLREDUCE") == "allreduce.fc.weight"
    assert row_name("allreduce.noname.3", "ALLREDUCE") == "allreduce.noname.3"
    assert row_name("grouped_allreduce.noname.1.0", "ALLREDUCE") == \
        "grouped_allreduce.noname.1.0"
    assert row_name("allreduce.x", "ALLGATHER") == "allgather.allreduce.x"
    for op in ("ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER"):
        assert row_name("t", op) == f"{op.lower()}.t"
    path = tmp_path / "t.json"
    with Timeline(path, rank=0) as tl:
        tl.start("cached", "ALLREDUCE")  # a cached tensor's row begins at its start
        tl.end("cached")
        tl.negotiate_start("ids", "ALLGATHER")
        tl.negotiate_end("ids")
    assert sorted(row_names(load(path)).values()) == ["allgather.ids", "allreduce.cached"]


@pytest.mark.unit
def test_unknown_op_is_refused_at_the_call(tmp_path):
    with Timeline(tmp_path / "t.json", rank=0) as tl:
        with pytest.raises(ValueError, match="ALLREDUCE"):
            tl.start("x", "ALLREDUCED")
        with pytest.raises(ValueError):
            tl.negotiate_start("x", "allreduce")


@pytest.mark.unit
def test_calls_out_of_order_still_give_balanced_rows(tmp_path):
    path = tmp_path / "t.json"
    with Timeline(path, rank=0) as tl:
        tl.negotiate_start("a", "ALLREDUCE")
        tl.start("a", "ALLREDUCE")  # negotiation never ended: start ends it
        tl.activity_start("a", "QUEUE")
        tl.activity_start("a", "GLOO_ALLREDUCE")  # previous activity still open
        tl.end("a")  # ends the activity, then the op
        tl.end("a")  # nothing open: dropped
        tl.activity_start("b", "QUEUE")  # outside an op: dropped
        tl.activity_end("b")
        tl.negotiate_end("b")
        tl.start("c", "BROADCAST")
        tl.activity_start("c", "GLOO_BROADCAST")  # left open: close() ends both
    events = load(path)
    assert_balanced(events)
    by_row = rows(events)
    assert by_row["allreduce.a"] == [
        ("B", "NEGOTIATE_ALLREDUCE"), ("E", "NEGOTIATE_ALLREDUCE"),
        ("B", "ALLREDUCE"), ("B", "QUEUE"), ("E", "QUEUE"),
        ("B", "GLOO_ALLREDUCE"), ("E", "GLOO_ALLREDUCE"), ("E", "ALLREDUCE"),
    ]  # fmt: skip
    assert by_row.get("b", []) == []
    assert by_row["broadcast.c"] == [
        ("B", "BROADCAST"),
        ("B", "GLOO_BROADCAST"),
        ("E", "GLOO_BROADCAST"),
        ("E", "BROADCAST"),
    ]


@pytest.mark.unit
def test_tensor_names_are_escaped(tmp_path):
    path = tmp_path / "t.json"
    weird = 'layer "1"\\bias\n\u00e9'
    with Timeline(path, rank=0) as tl:
        one_allreduce(tl, weird)
    assert list(rows(load(path))) == [f"allreduce.{weird}"]


@pytest.mark.unit
@pytest.mark.parametrize("mark_cycles", [False, True])
def test_cycle_markers_only_when_asked(tmp_path, mark_cycles):
    path = tmp_path / "t.json"
    with Timeline(path, rank=1, mark_cycles=mark_cycles) as tl:
        for i in range(3):
            tl.cycle_start()
            one_allreduce(tl, f"g{i}")
    events = load(path)
    cycles = [e for e in events if e["name"] == "CYCLE_START"]
    if not mark_cycles:
        assert cycles == []
        return
    assert [(e["ph"], e["pid"], e["tid"], e["s"]) for e in cycles] == [("i", 1, 0, "t")] * 3
    assert row_names(events)[(1, 0)] == "CYCLE_START"
    # Tensor rows never share the cycle row.
    assert all(e["tid"] != 0 for e in events if e["ph"] in "BE")


@pytest.mark.unit
def test_the_null_timeline_does_nothing_and_costs_next_to_nothing():
    assert NULL_TIMELINE.active is False
    assert not hasattr(NULL_TIMELINE, "__dict__")  # no state to lock or fill
    calls = 100_000
    began = time.perf_counter()
    for _ in range(calls):
        NULL_TIMELINE.start("grad", "ALLREDUCE")
        NULL_TIMELINE.activity_start("grad", "QUEUE")
        NULL_TIMELINE.cycle_start()
    per_call = (time.perf_counter() - began) / (3 * calls)
    # An empty method call is well under 1 us even on a loaded CI machine; this bound only
    # catches gross mistakes (I/O, formatting). The __dict__ check above is the real guard.
    assert per_call < 5e-6, per_call
    NULL_TIMELINE.close()
    NULL_TIMELINE.close()


@pytest.mark.unit
def test_concurrent_writers_produce_a_valid_complete_file(tmp_path):
    path = tmp_path / "t.json"
    threads, per_thread = 8, 300
    tl = Timeline(path, rank=0, mark_cycles=True, flush_interval=FAST)

    def work(t: int) -> None:
        for i in range(per_thread):
            one_allreduce(tl, f"t{t}.g{i % 20}")
            tl.cycle_start()

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    tl.close()
    events = load(path)
    assert_balanced(events)
    assert len(row_names(events)) == threads * 20 + 1
    ops = [e for e in events if e["ph"] == "B" and e["name"] == "ALLREDUCE"]
    assert len(ops) == threads * per_thread
    assert sum(e["name"] == "CYCLE_START" for e in events) == threads * per_thread


@pytest.mark.unit
def test_close_while_other_threads_call_is_safe_and_later_calls_are_ignored(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(path, rank=0, flush_interval=FAST)
    stop = threading.Event()
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                one_allreduce(tl, f"t{t}.g{i % 5}")
                i += 1
                time.sleep(0.0001)  # an engine thread between cycles, not a busy loop
        except BaseException as exc:  # surfaced below: a call after close must not raise
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for w in workers:
        w.start()
    time.sleep(0.05)
    tl.close()
    assert tl.active is False
    time.sleep(0.05)  # the workers keep calling a closed timeline
    size = path.stat().st_size
    time.sleep(0.05)
    stop.set()
    for w in workers:
        w.join()
    assert errors == []
    assert path.stat().st_size == size  # nothing written after close
    events = load(path)
    assert_balanced(events)
    assert any(e["ph"] == "B" for e in events)
    tl.close()  # idempotent


@pytest.mark.unit
def test_callers_outrunning_the_writer_are_dropped_and_rows_stay_balanced(tmp_path):
    path = tmp_path / "t.json"
    # The writer sleeps for the whole test, so only close() drains the queue.
    tl = Timeline(path, rank=0, flush_interval=timedelta(minutes=1), max_pending=7)
    for i in range(10):
        one_allreduce(tl, f"g{i}")
    tl.close()
    assert tl.dropped == 10 * 12 - 7
    events = load(path)
    assert_balanced(events)
    assert rows(events)["allreduce.g0"][:3] == [
        ("B", "NEGOTIATE_ALLREDUCE"),
        ("E", "NEGOTIATE_ALLREDUCE"),
        ("B", "ALLREDUCE"),
    ]


@pytest.mark.unit
def test_file_is_a_complete_array_between_flushes(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(path, rank=0, flush_interval=timedelta(milliseconds=10))
    try:
        assert [e["name"] for e in load(path)] == ["process_name", "process_sort_index"]
        for i in range(20):
            one_allreduce(tl, f"g{i}")
            load(path)  # valid whenever a reader looks, as Horovod users tail it live
        deadline = time.monotonic() + 5
        while not any(e["ph"] == "B" for e in load(path)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        tl.close()
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary files left


@pytest.mark.unit
def test_unopenable_path_fails_at_construction(tmp_path):
    with pytest.raises(OSError):
        Timeline(tmp_path / "missing-dir" / "t.json", rank=0)


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, threading, time
    from datetime import timedelta
    from hora.timeline import Timeline

    pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0  # between a thread's tensors

    tl = Timeline(sys.argv[1], 0, mark_cycles=True, flush_interval=timedelta(milliseconds=1))

    def work(t):
        i = 0
        while True:
            # Long names make batches span several pages, the hardest case to keep valid.
            name = f"rank0/thread{t}/" + "layer" * 40 + f".grad{i % 97}"
            tl.cycle_start()
            tl.negotiate_start(name, "ALLREDUCE")
            tl.negotiate_end(name)
            tl.start(name, "ALLREDUCE")
            tl.activity_start(name, "GLOO_ALLREDUCE")
            tl.activity_end(name)
            tl.end(name)
            i += 1
            if pause:
                time.sleep(pause)

    for t in range(3):
        threading.Thread(target=work, args=(t,), daemon=True).start()
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.multiprocess
def test_a_reader_never_sees_a_half_written_file(tmp_path):
    # Horovod users open the trace while the job runs. A reader racing a write
    # that spans pages used to see the file cut at a page boundary.
    path = tmp_path / "live.json"
    proc = subprocess.Popen(
        # A steady few MB/s: batches of tens of KiB, each spanning pages.
        [sys.executable, "-c", _KILLED_WRITER, str(path), "0.001"],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        reads, sizes = 0, set()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            text = path.read_text()
            try:
                json.loads(text)
            except json.JSONDecodeError as exc:
                pytest.fail(f"read {reads}: {len(text)} bytes are not JSON: {exc}")
            reads += 1
            sizes.add(len(text))
        assert len(sizes) > 10, "the writer hardly wrote; the race was not exercised"
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.multiprocess
def test_file_stays_valid_json_when_the_writer_is_killed(tmp_path):
    rng = random.Random(20240601)  # random moments, the same ones on every run
    for attempt in range(6):
        path = tmp_path / f"killed-{attempt}.json"
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_WRITER, str(path)],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == b"ready"
            header = path.stat().st_size
            deadline = time.monotonic() + 10
            while path.stat().st_size == header:  # the first batch is out
                assert time.monotonic() < deadline
                time.sleep(0.001)
            time.sleep(rng.random() * 0.2)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        events = load(path)
        assert events[0]["name"] == "process_name"
        assert any(e["ph"] == "B" for e in events), f"attempt {attempt}: nothing written"


@pytest.mark.unit
def test_without_o_tmpfile_a_hidden_temporary_name_is_used_and_removed(tmp_path, monkeypatch):
    real_open = os.open

    def no_tmpfile(path, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "no O_TMPFILE on this file system")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_tmpfile)
    path = tmp_path / "t.json"
    with Timeline(path, rank=3, flush_interval=FAST) as tl:
        one_allreduce(tl, "grad")
    assert ("B", "GLOO_ALLREDUCE") in rows(load(path))["allreduce.grad"]
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]
