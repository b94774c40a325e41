"""Helpers for unit tests of the coordinator's pure transitions (no servers, a fake clock)."""

from __future__ import annotations

from hora_coordinator import state
from hora_coordinator.messages import CoordinatorMessage, Event, JoinRequest, Response
from hora_proto.v1 import negotiation_pb2 as npb

__all__ = [
    "F32",
    "admits",
    "events_to",
    "form",
    "jreq",
    "responses_to",
    "sends",
    "submit",
    "treq",
]

F32 = "float32"


def jreq(worker: str, size: int, host: str = "h", hint: int = -1, **config) -> JoinRequest:
    return JoinRequest(
        job_id="job",
        worker_id=worker,
        host=host,
        pid=100 + len(worker),
        expected_size=size,
        rank_hint=hint,
        data_plane_address="127.0.0.1",
        **config,
    )


def treq(name: str, op=npb.OP_TYPE_ALLREDUCE, dtype=F32, shape=(4,), **kw) -> npb.TensorRequest:
    kw.setdefault("device", "cpu")
    kw.setdefault("reduce_op", npb.REDUCE_OP_SUM)
    kw.setdefault("prescale_factor", 1.0)
    kw.setdefault("postscale_factor", 1.0)
    return npb.TensorRequest(name=name, op_type=op, dtype=dtype, shape=list(shape), **kw)


def admits(effects) -> dict[str, state.WorldView]:
    return {e.worker_id: e.view for e in effects if isinstance(e, state.Admit)}


def sends(effects) -> list[state.Send]:
    return [e for e in effects if isinstance(e, state.Send)]


def form(size: int, hosts=None, hints=None, now=0.0, **config) -> state.Job:
    job = state.new_job("job", now)
    hosts = hosts or ["h"] * size
    hints = hints or [-1] * size
    effects = []
    for i in range(size):
        effects = state.join(job, jreq(f"w{i}", size, hosts[i], hints[i], **config), now)
    assert len(admits(effects)) == size
    return job


def submit(job: state.Job, rank: int, *requests: npb.TensorRequest, now: float = 0.0):
    # The table reads the wire's TensorRequest messages as they arrive.
    return state.handle_requests(job, f"w{rank}", job.generation, list(requests), now)


def responses_to(effects, worker: str) -> list[Response]:
    out: list[Response] = []
    for send in sends(effects):
        message: CoordinatorMessage = send.message
        if worker in send.worker_ids and message.responses is not None:
            out.extend(message.responses.responses)
    return out


def events_to(effects, worker: str) -> list[Event]:
    return [
        s.message.event
        for s in sends(effects)
        if worker in s.worker_ids and s.message.event is not None
    ]
