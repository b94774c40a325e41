"""Schemathesis over the coordinator's own OpenAPI document, against the live server.

Every route of ``/openapi.json`` gets generated requests (valid and
invalid path and query values); no answer may be a server error, and each
must match the status codes, content types and schemas the document
promises. Some jobs exist first (running, failed, elastic, with events), so
that the routes have state to show, not only 404s.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import schemathesis
from fuzz_target import FuzzTarget, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from hora_proto.v1 import rendezvous_pb2 as rpb
from hora_proto.v1 import rendezvous_pb2_grpc

pytestmark = [pytest.mark.multiprocess, pytest.mark.fuzz, pytest.mark.timeout(240)]

# Job id, size, Join settings: running, elastic, and one that finished.
JOBS_MADE: list[tuple[str, int, dict[str, int]]] = [
    ("running", 2, {}), ("elastic", 2, {"min_size": 1, "max_size": 3}), ("left", 1, {}),
]
JOBS = [job for job, _, _ in JOBS_MADE]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def populated(fuzz_target: FuzzTarget) -> Iterator[FuzzTarget]:
    """The target with a few jobs in different states."""
    proc = fuzz_target.proc
    with grpc.insecure_channel(proc.grpc_address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)

        def world(job: str, size: int, **config: int) -> None:
            joins = [
                stub.Join.future(rpb.JoinRequest(job_id=job, worker_id=f"w{i}", host=f"h{i}",
                                                 pid=i + 1, expected_size=size, rank_hint=-1,
                                                 **config),
                                 metadata=proc.metadata, timeout=10)
                for i in range(size)
            ]
            for join in joins:
                join.result()

        for job, size, config in JOBS_MADE:
            world(job, size, **config)
        for i in range(5):
            stub.ReportEvent(rpb.ReportEventRequest(job_id="running", kind="blacklist",
                                                    host="h0", message=f"event {i}"),
                             metadata=proc.metadata, timeout=5)
        stub.Leave(rpb.LeaveRequest(job_id="left", worker_id="w0", reason="done"),
                   metadata=proc.metadata, timeout=5)
    yield fuzz_target


def _refused_jobs_query(case: Case) -> bool:
    """Whether the server refuses this query of /api/v1/live (else it opens a stream)."""
    query = case.query or {}
    try:
        offset, limit = int(query.get("offset", 0)), int(query.get("limit", 200))
    except (TypeError, ValueError):
        return True
    return offset < 0 or not 1 <= limit <= 1000


def test_every_route_answers_as_its_schema_says(populated):
    # The Python API, not schemathesis' pytest plugin: the plugin's lazy
    # schemas (from a fixture, as a live server needs) do not run on pytest 9.
    schema = schemathesis.openapi.from_url(f"{populated.proc.http_url}/openapi.json", timeout=10)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 6, [op.label for op in operations]
    for operation in operations:
        strategies = [operation.as_strategy(GenerationMode.POSITIVE),
                      operation.as_strategy(GenerationMode.NEGATIVE)]
        if operation.path.endswith("/live"):
            # A request that opens a job's or the jobs' server-sent event stream is
            # answered for as long as the client listens (each such case would wait
            # out its 10 s timeout): here only the refused ones (bad query, unknown
            # job); tests/coordinator/test_rest_telemetry.py reads the streams.
            if "{job_id}" in operation.path:
                strategies = [s.filter(lambda case: case.path_parameters["job_id"] not in JOBS)
                              for s in strategies]
            else:
                strategies = [s.filter(_refused_jobs_query) for s in strategies]
        elif "{job_id}" in operation.path:  # some draws name the jobs that exist
            strategies += [operation.as_strategy(path_parameters={"job_id": job})
                           for job in JOBS]
        cases = st.one_of(strategies)

        @fuzz_settings(max_examples=25)
        @given(case=cases)
        def fuzz(case: Case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=10)

        fuzz()


def test_after_the_api_fuzzing_the_coordinator_serves_and_trains(fuzz_target, tmp_path):
    fuzz_target.assert_survived(tmp_path)
