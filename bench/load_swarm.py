"""Simulated hora workers for coordinator load tests: one grpc.aio loop, many workers.

Used by bench/locustfile.py (one locust user per simulated worker) and, as a
probe, on its own::

    python bench/load_swarm.py --address 127.0.0.1:PORT --token TOKEN --out probe.json

A simulated worker does what ``hvd.init()`` and a training loop do to the
coordinator, with the same messages and cadence as :mod:`hora.engine`:

1. Join (rendezvous); the workers of a job start together, as a launcher
   starts them, and the job is assembled when every one holds its world view;
2. one unary Heartbeat, then the data plane's bootstrap through the store
   (set its address, read its ring neighbours', count itself in with add);
3. opens its negotiation stream and negotiates the tensors of the first step
   (8 new tensors in one request list);
4. heartbeats on the stream at the interval the coordinator asks (``heartbeat
   = "unary"``: a unary Heartbeat every second instead, as the client did
   before heartbeats moved onto the stream), the first one at a random phase;
5. every ``tensor_every`` seconds negotiates one new tensor, every rank of the
   job in the same loop turn (as ranks reaching a new metric or a
   broadcast_object do); steady state is otherwise silent, as cached
   allreduces never reach the coordinator;
6. at the end, leaves (Leave, then closes its stream), all workers at once.

The workers of one simulated host (8, as on a large GPU node) share a
channel, with a TCP connection of its own (a local subchannel pool): 1,250
connections for 10,000 workers. Real workers each hold their own; a
connection per simulated worker made the generator's own loop stall for
seconds while a thousand of them connected at once, and its workers missed
their 2 s leases (the generator's stall, not the coordinator's).

Latencies are measured on this loop, so they include the time the loop takes
to get to them: with thousands of workers on one loop that is the load
generator's own queueing, not the coordinator's. The loop's lag is measured
too, and a probe (a small job in a process of its own) measures what a real
worker would see.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import random
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from swarm_worker import Worker

__all__ = ["Swarm", "SwarmOptions", "cpu_seconds", "latencies", "rss_mib"]

# The real client's channel options (hora._client.CoordinatorClient), and a
# connection per worker: a process of its own would not share one.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.use_local_subchannel_pool", 1),
]


@dataclass(frozen=True)
class SwarmOptions:
    """What a swarm simulates and where it reports.

    Attributes:
        address: coordinator gRPC ``HOST:PORT``.
        token: the job token.
        http: coordinator HTTP URL, for /metrics (empty: no counters).
        pid: coordinator pid, for its CPU and RSS (0: not measured).
        job_size: workers per job.
        heartbeat: "stream" (hora's client) or "unary" (the client before it).
        tensor_every: seconds between new tensors negotiated by every rank.
        steady_s: seconds measured once every job is assembled.
        out: where the JSON summary goes (empty: nowhere).
        prefix: job id prefix.
        probe: run until :meth:`Swarm.finish`, keeping every timestamped sample.
        feed_locust: queue every sample for locust's statistics.
    """

    address: str
    token: str
    http: str = ""
    pid: int = 0
    job_size: int = 10
    heartbeat: str = "stream"
    tensor_every: float = 10.0
    steady_s: float = 30.0
    out: str = ""
    prefix: str = "load"
    probe: bool = False
    feed_locust: bool = False


def cpu_seconds(pid: int | str) -> float:
    """User plus system CPU seconds of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int | str) -> float:
    """Resident set size of a process in MiB (VmRSS)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Samples:
    """Latencies in seconds, each with the wall-clock time it ended; errors by kind."""

    heartbeat: list[tuple[float, float]] = field(default_factory=list)
    negotiation: list[tuple[float, float]] = field(default_factory=list)
    loop_lag: list[tuple[float, float]] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)

    def within(self, kind: str, start: float, end: float) -> list[float]:
        """The ``kind`` latencies that ended in [start, end] (wall clock)."""
        return [s for t, s in getattr(self, kind) if start <= t <= end]


class Swarm:
    """Simulated workers on one grpc.aio event loop, in a real thread of this process.

    :meth:`add_worker` and :meth:`finish` may be called from any thread (locust's
    greenlets); everything else runs on the loop.
    """

    def __init__(self, options: SwarmOptions, expected_workers: int) -> None:
        # Thousands of workers' objects made each full collection of the cyclic GC
        # stall this loop for 1.5 s (47 s of the generator's 100 s run went to it):
        # the generator's own stall, measured as coordinator latency. A run is
        # minutes long; its cycles can wait.
        gc.disable()
        self.o = options
        self.job_size = options.job_size
        self.expected_jobs = max(1, expected_workers // self.job_size)
        self.metadata = (("hora-token", options.token),)
        self.loop = asyncio.new_event_loop()
        self.samples = Samples()
        self.done = threading.Event()
        self.for_locust: collections.deque[tuple[str, float, str | None]] = collections.deque()
        self.summary: dict[str, Any] = {}
        self._added = 0
        self._jobs: dict[int, list[Worker]] = {}
        # Per job: how many workers joined / finished their first step, and the latest time.
        self._joined: dict[int, list[float]] = {}
        self._first_steps: dict[int, list[float]] = {}
        self._assembled: list[float] = []
        self._ready: list[float] = []
        self._ready_jobs = 0
        self._rounds: list[asyncio.Future[None]] = []
        self._channels: dict[tuple[int, int], grpc.aio.Channel] = {}
        self._all_ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="hora-swarm", daemon=True)
        self._thread.start()

    # -- from other threads --------------------------------------------------------

    def add_worker(self) -> None:
        index = self._added
        self._added += 1
        self.loop.call_soon_threadsafe(self._admit, index)

    def finish(self) -> None:
        """Ends the run (early, or a probe's): writes what was measured."""
        self.loop.call_soon_threadsafe(self._stop.set)

    # -- on the loop ---------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    def _admit(self, index: int) -> None:
        job, rank = divmod(index, self.job_size)
        workers = self._jobs.setdefault(job, [])
        workers.append(Worker(self, job, rank))
        if len(workers) == self.job_size:  # a launcher starts the whole job at once
            start = time.perf_counter()
            for w in workers:
                w.task = asyncio.ensure_future(w.live(start))

    def channel(self, job: int, host: int) -> grpc.aio.Channel:
        """The channel (and TCP connection) of one simulated host of a job."""
        key = (job, host)
        if key not in self._channels:
            self._channels[key] = grpc.aio.insecure_channel(self.o.address,
                                                            options=CHANNEL_OPTIONS)
        return self._channels[key]

    def record(self, kind: str, seconds: float, error: str | None = None) -> None:
        if error is not None:
            self.samples.errors[f"{kind}: {error}"] += 1
        elif kind == "heartbeat":
            self.samples.heartbeat.append((time.time(), seconds))
        elif kind == "negotiation":
            self.samples.negotiation.append((time.time(), seconds))
        if self.o.feed_locust:
            self.for_locust.append((kind, seconds, error))

    def joined(self, job: int, seconds: float) -> None:
        """A worker of ``job`` holds its world view, ``seconds`` after the job started."""
        count = self._joined.setdefault(job, [0, 0.0])
        count[0] += 1
        count[1] = max(count[1], seconds)
        if count[0] == self.job_size:
            self._assembled.append(count[1])

    def first_step_done(self, job: int, seconds: float) -> None:
        """A worker of ``job`` has its store bootstrap, its stream and its first step's
        tensors negotiated; once all have, the job runs and its rounds start."""
        count = self._first_steps.setdefault(job, [0, 0.0])
        count[0] += 1
        count[1] = max(count[1], seconds)
        if count[0] < self.job_size:
            return
        self._ready.append(count[1])
        self._rounds.append(asyncio.ensure_future(self._new_tensors(self._jobs[job])))
        self._ready_jobs += 1
        if self._ready_jobs >= self.expected_jobs:
            self._all_ready.set()

    async def _new_tensors(self, workers: list[Worker]) -> None:
        """Every ``tensor_every`` s, every rank of the job submits one new tensor
        in the same loop turn, as ranks reaching the same step do (each job at its own
        phase)."""
        period = self.o.tensor_every
        await asyncio.sleep(random.uniform(0, period))
        k = 0
        while True:
            k += 1
            for w in workers:
                w.send_requests([f"metric.{k}"])
            await asyncio.sleep(period)

    async def _watch_loop(self) -> None:
        """How late this loop wakes a sleeper: the generator's own queueing delay."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.05)
            self.samples.loop_lag.append((time.time(), time.perf_counter() - start - 0.05))

    async def _main(self) -> None:
        watch = asyncio.ensure_future(self._watch_loop())
        try:
            if self.o.probe:
                await self._probe()
            else:
                await self._measure()
        except Exception as exc:  # the summary says what broke
            self.summary["failure"] = f"{type(exc).__name__}: {exc}"
        finally:
            watch.cancel()
            for channel in self._channels.values():
                await channel.close()
            self._write()
            self.done.set()

    async def _probe(self) -> None:
        """A probe's run: its job assembles, then it works until :meth:`finish`."""
        await self._stop.wait()
        await self._leave_all()

    async def _measure(self) -> None:
        ready = asyncio.ensure_future(self._all_ready.wait())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([ready, stop], return_when=asyncio.FIRST_COMPLETED)
        if not self._all_ready.is_set():
            self.summary["failure"] = (f"stopped before every job was assembled "
                                       f"({self._ready_jobs} of {self.expected_jobs})")
            return
        pid = self.o.pid
        load0 = os.getloadavg()[0]
        wall0 = time.time()
        start, cpu0, own0 = time.perf_counter(), cpu_seconds(pid), cpu_seconds("self")
        with_stop = asyncio.ensure_future(asyncio.sleep(self.o.steady_s))
        await asyncio.wait([with_stop, stop], return_when=asyncio.FIRST_COMPLETED)
        elapsed = time.perf_counter() - start
        self.summary.update(
            steady_window=[wall0, time.time()],
            loadavg=[load0, os.getloadavg()[0]],
            steady_s=elapsed,
            coordinator_cpu=(cpu_seconds(pid) - cpu0) / elapsed,
            generator_cpu=(cpu_seconds("self") - own0) / elapsed,
            coordinator_rss_mib=rss_mib(pid),
            metrics_steady=self._metrics(),
        )
        await self._leave_all()

    async def _leave_all(self) -> None:
        for rounds in self._rounds:
            rounds.cancel()
        before = self._metrics()
        workers = [w for ws in self._jobs.values() for w in ws if w.task is not None]
        for w in workers:
            w.stop()
        start = time.perf_counter()
        await asyncio.gather(*(w.task for w in workers if w.task), return_exceptions=True)
        self.summary["leave_s"] = time.perf_counter() - start
        await asyncio.sleep(1.0)  # coalesced departure notices go out at the next checks
        after = self._metrics()
        self.summary.update(leaves=len(workers), metrics_before_leaves=before,
                            metrics_after_leaves=after)

    def _metrics(self) -> dict[str, float]:
        """The coordinator's counters summed over jobs: stream messages, heartbeats, ..."""
        if not self.o.http:
            return {}
        totals: dict[str, float] = collections.defaultdict(float)
        with urllib.request.urlopen(f"{self.o.http}/metrics", timeout=30) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("#") or "{" not in line:
                    continue
                name, labels = line.split("{", 1)
                value = float(line.rsplit(" ", 1)[1])
                if 'transport="' in labels:
                    name += "." + labels.split('transport="')[1].split('"')[0]
                if name in ("hora_lease_seconds", "hora_heartbeat_interval_seconds"):
                    totals[name] = max(totals[name], value)
                else:
                    totals[name] += value
        return dict(totals)

    def _write(self) -> None:
        s = self.samples
        self.summary.update(
            heartbeat_mode=self.o.heartbeat,
            workers=self._added,
            job_size=self.job_size,
            jobs_assembled=len(self._assembled),
            assemble_s=sorted(self._assembled),
            ready_s=sorted(self._ready),
            errors=dict(s.errors.most_common(20)),
        )
        if "steady_window" in self.summary:
            self.summary.update(latencies(s, *self.summary["steady_window"]))
        if self.o.probe:  # the driver picks the main swarm's steady window out of these
            self.summary["samples"] = {"heartbeat": s.heartbeat, "negotiation": s.negotiation}
        if self.o.out:
            with open(self.o.out, "w", encoding="utf-8") as f:
                json.dump(self.summary, f, indent=1)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def latencies(samples: Samples, start: float, end: float) -> dict[str, Any]:
    """Counts and p50 / p99 in milliseconds of the samples that ended in [start, end]."""
    out: dict[str, Any] = {}
    for kind in ("heartbeat", "negotiation", "loop_lag"):
        values = samples.within(kind, start, end)
        out[f"{kind}_n"] = len(values)
        out[f"{kind}_p50_ms"] = _ms(percentile(values, 0.50))
        out[f"{kind}_p99_ms"] = _ms(percentile(values, 0.99))
    return out


def main() -> None:
    """The probe: one small job in a process of its own, until SIGTERM."""
    parser = argparse.ArgumentParser(description="a probe job of simulated hora workers")
    parser.add_argument("--address", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--job-size", type=int, default=2)
    parser.add_argument("--tensor-every", type=float, default=1.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    options = SwarmOptions(address=args.address, token=args.token, job_size=args.job_size,
                           tensor_every=args.tensor_every, out=args.out, prefix="probe",
                           probe=True)
    swarm = Swarm(options, args.job_size)
    signal.signal(signal.SIGTERM, lambda *_: swarm.finish())
    for _ in range(args.job_size):
        swarm.add_worker()
    while not swarm.done.wait(0.5):
        pass


if __name__ == "__main__":
    main()
