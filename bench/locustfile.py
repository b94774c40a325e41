"""Locust load on one hora coordinator: every locust user is one simulated worker.

    make bench-coordinator                      # the scenarios, via bench/coordinator_load.py
    LOCUST_SKIP_MONKEY_PATCH=1 .venv/bin/locust -f bench/locustfile.py --headless \\
        -u 1000 -r 500 --hora-address 127.0.0.1:PORT --hora-token TOKEN --hora-job-size 1000

What a simulated worker does (Join, the store bootstrap, heartbeats on its
negotiation stream at the coordinator's interval, new tensors, Leave) is in
bench/load_swarm.py. Locust spawns the users, keeps the clock and aggregates
the request statistics; the swarm measures, writes a JSON summary
(``--hora-out``) and then stops locust itself.

Why not gevent: grpc's gevent mode (``grpc.experimental.gevent.init_gevent``)
measured here at 0.38 ms of CPU per stream message and a p99 round trip of
950 ms with 500 streams, against 0.22 ms and 2 ms for grpc.aio. So the
workers' gRPC runs on one grpc.aio event loop in a real thread of this
process, and locust must not monkey-patch it: run with
``LOCUST_SKIP_MONKEY_PATCH=1`` (grpc.aio on a monkey-patched thread hangs).
One locust process is enough: the load generator shares the 2 cores with the
coordinator, and a second process would only take CPU from it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import gevent
from gevent import monkey
from locust import User, events, task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_swarm import Swarm, SwarmOptions  # noqa: E402

if monkey.is_module_patched("socket"):
    raise SystemExit("bench/locustfile.py: run locust with LOCUST_SKIP_MONKEY_PATCH=1 "
                     "(its workers use grpc.aio on a real thread, not gevent)")


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("hora")
    group.add_argument("--hora-address", default="127.0.0.1:50051", help="coordinator gRPC")
    group.add_argument("--hora-http", default="", help="coordinator HTTP URL (for /metrics)")
    group.add_argument("--hora-token", default="", help="job token")
    group.add_argument("--hora-pid", type=int, default=0, help="coordinator pid (CPU, RSS)")
    group.add_argument("--hora-job-size", type=int, default=10, help="workers per job")
    group.add_argument("--hora-heartbeat", choices=["stream", "unary"], default="stream")
    group.add_argument("--hora-tensor-every", type=float, default=10.0,
                       help="seconds between new tensors negotiated by every rank")
    group.add_argument("--hora-steady-s", type=float, default=30.0,
                       help="seconds measured once every job is assembled")
    group.add_argument("--hora-out", default="", help="JSON summary written here")
    group.add_argument("--hora-prefix", default="load", help="job id prefix")


SWARM: Swarm | None = None


@events.init.add_listener
def _start(environment: Any, **_: Any) -> None:
    global SWARM
    o = environment.parsed_options
    if o is None:
        return
    swarm = SWARM = Swarm(SwarmOptions(
        address=o.hora_address, token=o.hora_token, http=o.hora_http, pid=o.hora_pid,
        job_size=o.hora_job_size, heartbeat=o.hora_heartbeat,
        tensor_every=o.hora_tensor_every, steady_s=o.hora_steady_s, out=o.hora_out,
        prefix=o.hora_prefix, feed_locust=True), o.num_users or 0)

    def feed_locust() -> None:
        """Hands the loop's samples to locust's statistics, on locust's own hub."""
        while True:
            while swarm.for_locust:
                kind, seconds, error = swarm.for_locust.popleft()
                environment.events.request.fire(
                    request_type="grpc", name=kind, response_time=seconds * 1000,
                    response_length=0, exception=RuntimeError(error) if error else None,
                    context={})
            if swarm.done.is_set() and not swarm.for_locust:
                if environment.runner is not None:
                    environment.runner.quit()
                return
            gevent.sleep(0.2)

    gevent.spawn(feed_locust)


@events.test_stopping.add_listener
def _stopping(**_: Any) -> None:
    if SWARM is not None and not SWARM.done.is_set():
        SWARM.finish()
        SWARM.done.wait(timeout=120)


class HoraWorker(User):
    """One simulated worker; its life runs on the swarm's loop (bench/load_swarm.py)."""

    def on_start(self) -> None:
        if SWARM is not None:
            SWARM.add_worker()

    @task
    def live(self) -> None:
        gevent.sleep(3600)
