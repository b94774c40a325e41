"""Issue 25, finding 4: a token opens one job, and a worker speaks only for itself.

Real coordinator processes, real gRPC and HTTP clients. Job B is a real 2-rank
``horarun`` job (real workers, real Gloo) that keeps training while job A's
token holder tries everything the issue lists against it: read, leave,
heartbeat (fake telemetry), store get/set/delete, events, re-attach, a
negotiation stream. Every try is PERMISSION_DENIED and job B finishes with the
right sums. Off loopback (a network namespace of the test's own), the REST API
shows a job token its own job only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from support.rest_probe import PROBE, run_inside

from hora_proto.auth import (
    WORKER_SECRET_METADATA_KEY,
    cookie_value,
    job_of_token,
    job_token,
    worker_secret,
)
from hora_proto.v1 import (
    negotiation_pb2,
    negotiation_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

HORARUN = [sys.executable, "-m", "hora.runner.launch"]
DENIED = grpc.StatusCode.PERMISSION_DENIED
CALL_S = 10.0

# Job B's workers: train until the test says go (a file), then one last sum.
WORKER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    import hora.torch as hvd

    out = Path(sys.argv[1])
    hvd.init()
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps({"token": os.environ["HORA_TOKEN"]}))
    deadline = time.monotonic() + 90
    steps = 0
    while True:
        # The ranks stop together: whether either has seen "go" rides in the step's sum,
        # so no rank leaves for "final" while the other starts one more step.
        go = float((out / "go").exists() or time.monotonic() > deadline)
        total = hvd.allreduce(torch.tensor([1.0] * 4 + [go]), op=hvd.Sum,
                              name=f"step.{steps % 8}")
        assert total[:4].tolist() == [2.0] * 4, total
        if total[4] > 0:
            break
        steps += 1
        time.sleep(0.05)
    final = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="final")
    (out / f"done{hvd.rank()}.json").write_text(json.dumps({"sum": final.item(), "steps": steps}))
    hvd.shutdown()
""")


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


class Stubs:
    """The three hora.v1 stubs on a channel of its own (its own TCP connection)."""

    def __init__(self, address: str, token: str, secret: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.metadata: tuple[tuple[str, str], ...] = (("hora-token", token),)
        if secret is not None:
            self.metadata += ((WORKER_SECRET_METADATA_KEY, secret),)
        self.rendezvous = rendezvous_pb2_grpc.RendezvousStub(self.channel)
        self.store = store_pb2_grpc.StoreStub(self.channel)
        self.negotiation = negotiation_pb2_grpc.NegotiationStub(self.channel)

    def call(self, method: Callable[..., Any], request: Any) -> grpc.StatusCode:
        return _code(lambda: method(request, metadata=self.metadata, timeout=CALL_S))

    def close(self) -> None:
        self.channel.close()


def _join(stubs: Stubs, job: str, worker: str, size: int, **extra: Any
          ) -> rendezvous_pb2.JoinResponse:
    return stubs.rendezvous.Join(rendezvous_pb2.JoinRequest(
        job_id=job, worker_id=worker, host="localhost", pid=4242, expected_size=size,
        rank_hint=-1, data_plane_address="127.0.0.1", **extra),
        metadata=stubs.metadata, timeout=CALL_S)


def _every_call_into(stubs: Stubs, job: str, worker: str, kind: str
                     ) -> dict[str, grpc.StatusCode]:
    """What ``stubs`` gets for each thing the issue says a token holder could do to ``job``."""
    r, s = stubs.rendezvous, stubs.store
    world = rendezvous_pb2.WorldView(job_id=job, generation=1, size=2, rank=0)
    join = rendezvous_pb2.JoinRequest(job_id=job, worker_id=worker, expected_size=2)
    telemetry = rendezvous_pb2.RankTelemetry(steps=10**15)
    codes = {
        "leave": stubs.call(r.Leave, rendezvous_pb2.LeaveRequest(job_id=job, worker_id=worker)),
        "heartbeat": stubs.call(r.Heartbeat, rendezvous_pb2.HeartbeatRequest(
            job_id=job, worker_id=worker, generation=1, telemetry=telemetry)),
        "get_world": stubs.call(r.GetWorld, rendezvous_pb2.GetWorldRequest(
            job_id=job, worker_id=worker)),
        "report_event": stubs.call(r.ReportEvent, rendezvous_pb2.ReportEventRequest(
            job_id=job, kind=kind, message="forged")),
        "list_events": stubs.call(r.ListEvents, rendezvous_pb2.ListEventsRequest(job_id=job)),
        "reattach": stubs.call(r.Reattach, rendezvous_pb2.ReattachRequest(
            join=join, world=world, host_update_epoch=2**63 - 1)),
        "store_set": stubs.call(s.Set, store_pb2.StoreSetRequest(job_id=job, key="k", value=b"v")),
        "store_get": stubs.call(s.Get, store_pb2.StoreGetRequest(job_id=job, key="k",
                                                                   timeout_ms=100)),
        "store_add": stubs.call(s.Add, store_pb2.StoreAddRequest(job_id=job, key="n", amount=1)),
        "store_delete": stubs.call(s.Delete, store_pb2.StoreDeleteRequest(job_id=job, key="k")),
        "process_set": stubs.call(stubs.negotiation.AddProcessSet, negotiation_pb2.AddProcessSetRequest(
            job_id=job, worker_id=worker, generation=1, process_set_id=1, ranks=[0])),
    }
    opening = negotiation_pb2.WorkerMessage(
        open=negotiation_pb2.StreamOpen(job_id=job, worker_id=worker, generation=1))
    codes["negotiate"] = _code(lambda: list(stubs.negotiation.Negotiate(
        iter([opening]), metadata=stubs.metadata, timeout=CALL_S)))
    return codes


@pytest.fixture
def job_b(coordinator_factory, tmp_path) -> Iterator[tuple[Any, str, Path, subprocess.Popen]]:
    """A coordinator, and a real 2-rank horarun job training on it (given the admin token)."""
    coordinator = coordinator_factory("--lease-s", "5")
    job = f"job-b-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.Popen(
        [*HORARUN, "--coordinator", coordinator.grpc_address, "--token", coordinator.token,
         "--job-id", job, "-np", "2", sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"rank{r}.json").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate(timeout=10)[0][-4000:]
            assert time.monotonic() < deadline, "job B's workers did not start in 90 s"
            time.sleep(0.1)
        yield coordinator, job, tmp_path, proc
    finally:
        (tmp_path / "go").touch()
        if proc.poll() is None:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _members(coordinator, job: str) -> list[str]:
    detail = httpx.get(f"{coordinator.http_url}/api/v1/jobs/{job}", timeout=10).json()
    return [m["worker_id"] for m in detail["members"]]


def test_a_job_token_cannot_touch_another_running_job(job_b):
    coordinator, job, out, proc = job_b
    admin = coordinator.token
    # horarun handed its workers job B's token, never the admin token.
    for rank in (0, 1):
        given = json.loads((out / f"rank{rank}.json").read_text())["token"]
        assert given != admin and given == job_token(admin, job)
        assert admin not in given
    victims = _members(coordinator, job)
    assert len(victims) == 2

    token_a = job_token(admin, "job-a")
    outsider = Stubs(coordinator.grpc_address, token_a)
    # A worker of job B itself, holding B's token but not the victim's secret.
    insider = Stubs(coordinator.grpc_address, job_token(admin, job), secret="not-the-secret")
    try:
        for who, stubs in (("job A's token", outsider), ("job B's token, no secret", insider)):
            codes = _every_call_into(stubs, job, victims[0], kind=f"forged by {who}")
            if who == "job B's token, no secret":
                # Calls that name no worker are the job's own: B's token may make them.
                for name in ("report_event", "list_events", "store_set", "store_get",
                             "store_add", "store_delete"):
                    codes.pop(name)
            assert codes == dict.fromkeys(codes, DENIED), (who, codes)
        # Nor may a holder of B's token take a member's place by joining under its id.
        assert _code(lambda: _join(insider, job, victims[1], 2)) == DENIED
        # Job A's token opens job A: the same calls there are not refused for scope.
        assert outsider.call(outsider.store.Set, store_pb2.StoreSetRequest(
            job_id="job-a", key="k", value=b"v")) == grpc.StatusCode.NOT_FOUND  # no such job yet
    finally:
        outsider.close()
        insider.close()

    admin_stubs = Stubs(coordinator.grpc_address, admin)
    try:
        events = admin_stubs.rendezvous.ListEvents(
            rendezvous_pb2.ListEventsRequest(job_id=job), metadata=admin_stubs.metadata,
            timeout=CALL_S).events
        assert events and not any(e.kind == "forged by job A's token" for e in events)
        assert not any(e.kind in ("left", "lost", "failed") for e in events), events
    finally:
        admin_stubs.close()
    # Job B is unharmed: both members still there, and it finishes with the right sum.
    assert sorted(_members(coordinator, job)) == sorted(victims)
    (out / "go").touch()
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output[-4000:]
    for rank in (0, 1):
        done = json.loads((out / f"done{rank}.json").read_text())
        assert done["sum"] == 3.0 and done["steps"] > 0


def test_a_worker_speaks_only_for_itself(coordinator_factory):
    coordinator = coordinator_factory("--lease-s", "10")
    admin, job = coordinator.token, f"job-{uuid.uuid4().hex[:6]}"
    token = job_token(admin, job)
    joiner = Stubs(coordinator.grpc_address, token)
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda w: _join(joiner, job, w, 2), ["w0", "w1"]))
    finally:
        joiner.close()
    secrets_ = {a.world.members[a.world.rank].worker_id: a.worker_secret for a in answers}
    assert secrets_["w0"] != secrets_["w1"] and token not in secrets_.values()
    assert secrets_["w0"] == worker_secret(admin, job, "w0")  # stateless: survives a restart

    def heartbeat(stubs: Stubs, worker: str) -> grpc.StatusCode:
        return stubs.call(stubs.rendezvous.Heartbeat, rendezvous_pb2.HeartbeatRequest(
            job_id=job, worker_id=worker, generation=answers[0].world.generation))

    as_w0 = Stubs(coordinator.grpc_address, token, secret=secrets_["w0"])
    bare = Stubs(coordinator.grpc_address, token)
    as_admin = Stubs(coordinator.grpc_address, admin)
    try:
        assert heartbeat(as_w0, "w0") == grpc.StatusCode.OK
        assert heartbeat(as_w0, "w1") == DENIED  # w0's secret does not open w1
        assert heartbeat(bare, "w1") == DENIED
        assert as_w0.call(as_w0.rendezvous.Leave, rendezvous_pb2.LeaveRequest(
            job_id=job, worker_id="w1")) == DENIED
        assert _code(lambda: _join(as_w0, job, "w1", 2)) == DENIED
        assert heartbeat(as_admin, "w1") == grpc.StatusCode.OK  # the admin token is not scoped
        # w1 is still a member: nothing above took its place or failed it.
        world = as_admin.rendezvous.GetWorld(rendezvous_pb2.GetWorldRequest(
            job_id=job, worker_id="w1"), metadata=as_admin.metadata, timeout=CALL_S)
        assert sorted(m.worker_id for m in world.world.members) == ["w0", "w1"]
    finally:
        for stubs in (as_w0, bare, as_admin):
            stubs.close()


def test_values_that_would_overflow_later_are_refused(coordinator_factory):
    coordinator = coordinator_factory("--lease-s", "10")
    admin, job = coordinator.token, f"job-{uuid.uuid4().hex[:6]}"
    stubs = Stubs(coordinator.grpc_address, admin)
    try:
        first = _join(stubs, job, "w0", 1)
        world = first.world
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        for epoch in (2**63 - 1, 2**53 + 1, -1):
            request = rendezvous_pb2.ReattachRequest(
                join=rendezvous_pb2.JoinRequest(job_id=job, worker_id="w0", host="localhost",
                                                pid=4242, expected_size=1, rank_hint=-1,
                                                data_plane_address="127.0.0.1"),
                world=world, host_update_epoch=epoch)
            assert stubs.call(stubs.rendezvous.Reattach, request) == invalid, epoch
        huge_generation = rendezvous_pb2.WorldView()
        huge_generation.CopyFrom(world)
        huge_generation.generation = 2**63 - 1
        assert stubs.call(stubs.rendezvous.Reattach, rendezvous_pb2.ReattachRequest(
            join=rendezvous_pb2.JoinRequest(job_id=job, worker_id="w0", expected_size=1),
            world=huge_generation)) == invalid
        for field in ("stall_shutdown_ms", "elastic_timeout_ms", "fusion_threshold_bytes"):
            assert _code(lambda f=field: _join(stubs, f"{job}-x", "w9", 1, **{f: 2**62})) \
                == invalid, field
        # The job kept going: its member heartbeats as before.
        answer = stubs.rendezvous.Heartbeat(rendezvous_pb2.HeartbeatRequest(
            job_id=job, worker_id="w0", generation=world.generation),
            metadata=stubs.metadata, timeout=CALL_S)
        assert answer.host_update_epoch < 2**53
    finally:
        stubs.close()


def test_wrong_tokens_are_slowed_down_but_not_the_right_one(coordinator_factory):
    coordinator = coordinator_factory("--guess-burst", "20", "--guess-rate", "0.2")
    address, admin = coordinator.grpc_address, coordinator.token
    request = rendezvous_pb2.ListEventsRequest(job_id="no-such-job")
    worker = Stubs(address, admin)  # a worker's connection, proven before the guessing
    guesser = Stubs(address, "guess")
    late = None
    try:
        assert worker.call(worker.rendezvous.ListEvents, request) == grpc.StatusCode.NOT_FOUND
        codes = [guesser.call(guesser.rendezvous.ListEvents, request) for _ in range(40)]
        assert codes[:20] == [grpc.StatusCode.UNAUTHENTICATED] * 20
        assert codes[20:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 20
        # A guess is no longer checked: even the right token on a new connection of
        # that address is refused, so a guesser learns nothing while limited...
        late = Stubs(address, admin)
        assert late.call(late.rendezvous.ListEvents, request) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        # ...and the worker's connection is not slowed.
        assert worker.call(worker.rendezvous.ListEvents, request) == grpc.StatusCode.NOT_FOUND
    finally:
        for stubs in (worker, guesser, late):
            if stubs is not None:
                stubs.close()


def test_weak_tokens_warn_on_loopback_and_are_refused_off_it(coordinator_factory, netns):
    weak = coordinator_factory(token="abc")
    stubs = Stubs(weak.grpc_address, "abc")
    try:
        assert stubs.call(stubs.rendezvous.ListEvents, rendezvous_pb2.ListEventsRequest(
            job_id="x")) == grpc.StatusCode.NOT_FOUND
    finally:
        stubs.close()
    assert "bits of entropy" in weak.log()
    done = subprocess.run(
        [*netns.prefix, sys.executable, "-m", "hora_coordinator", "--host", netns.address,
         "--token", "abc"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "HORA_TOKEN": ""})
    assert done.returncode == 1 and "--allow-weak-token" in done.stderr, done.stderr


JOIN = textwrap.dedent("""
    import sys
    import grpc
    from hora_proto.v1 import rendezvous_pb2, rendezvous_pb2_grpc
    address, token = sys.argv[1], sys.argv[2]
    with grpc.insecure_channel(address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)
        for job in sys.argv[3:]:
            stub.Join(rendezvous_pb2.JoinRequest(
                job_id=job, worker_id="w0", host="h", pid=1, expected_size=1, rank_hint=-1,
                data_plane_address="127.0.0.1"), metadata=(("hora-token", token),), timeout=10)
""")


def test_off_loopback_a_job_token_reads_its_job_only(coordinator_factory, netns):
    coordinator = coordinator_factory(host=netns.address, command_prefix=netns.prefix)
    admin = coordinator.token
    job_a, job_b = f"job-a-{uuid.uuid4().hex[:6]}", f"job-b-{uuid.uuid4().hex[:6]}"
    run_inside(netns, "-c", JOIN, coordinator.grpc_address, admin, job_a, job_b)
    token_a = job_token(admin, job_a)
    assert job_of_token(admin, token_a) == job_a and job_of_token("other", token_a) is None
    a = {"Authorization": f"Bearer {token_a}"}
    cases = {
        "list_a": ("/api/v1/jobs", a, {}),
        "job_a": (f"/api/v1/jobs/{job_a}", a, {}),
        "events_a": (f"/api/v1/jobs/{job_a}/events", a, {}),
        "job_b": (f"/api/v1/jobs/{job_b}", a, {}),
        "events_b": (f"/api/v1/jobs/{job_b}/events", a, {}),
        "ranks_b": (f"/api/v1/jobs/{job_b}/ranks", a, {}),
        "telemetry_b": (f"/api/v1/jobs/{job_b}/telemetry", a, {}),
        "page_b": (f"/jobs/{job_b}", a, {}),
        "live_all": ("/api/v1/live", a, {}),
        "metrics": ("/metrics", a, {}),
        "root": ("/", a, {}),
        "query_a": (f"/api/v1/jobs/{job_a}?token={token_a}", {}, {}),
        "cookie_b": (f"/api/v1/jobs/{job_b}", {}, {"hora_token": cookie_value(admin, job_a)}),
        "cookie_a": (f"/api/v1/jobs/{job_a}", {}, {"hora_token": cookie_value(admin, job_a)}),
        "admin_list": ("/api/v1/jobs", {"Authorization": f"Bearer {admin}"}, {}),
        "admin_b": (f"/api/v1/jobs/{job_b}", {}, {"hora_token": cookie_value(admin, None)}),
    }
    seen = json.loads(run_inside(netns, "-c", PROBE, coordinator.http_url, json.dumps(cases)))
    assert [j["job_id"] for j in json.loads(seen["list_a"]["body"])] == [job_a]
    for name in ("job_a", "events_a", "query_a", "cookie_a", "admin_list", "admin_b"):
        assert seen[name]["status"] == 200, (name, seen[name])
    for name in ("job_b", "events_b", "ranks_b", "telemetry_b", "page_b", "live_all",
                 "metrics", "cookie_b"):
        assert seen[name]["status"] == 403, (name, seen[name])
        assert "w0" not in seen[name]["body"]
    assert seen["root"]["status"] == 303 and seen["root"]["location"].endswith(f"/jobs/{job_a}")
    assert {j["job_id"] for j in json.loads(seen["admin_list"]["body"])} >= {job_a, job_b}
    # The cookie holds a value derived from the token, never the token.
    cookie = seen["query_a"]["set_cookie"]
    assert cookie.startswith(f"hora_token={cookie_value(admin, job_a)};"), cookie
    assert token_a not in cookie and admin not in cookie


def test_operators_can_print_a_jobs_token(tmp_path):
    admin = "a" * 8 + uuid.uuid4().hex
    done = subprocess.run(
        [sys.executable, "-m", "hora_coordinator", "--token", admin, "--print-job-token", "j 1"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == job_token(admin, "j 1") and admin not in done.stdout
    # Without any admin token it makes none up (and writes no token file).
    token_file = tmp_path / "token"
    done = subprocess.run(
        [sys.executable, "-m", "hora_coordinator", "--token-file", str(token_file),
         "--print-job-token", "j"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "HORA_TOKEN": ""})
    assert done.returncode == 1 and not token_file.exists(), done.stderr
