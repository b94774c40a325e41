"""The negotiation table: which named tensors are ready on which ranks.

Pure logic, no I/O and no clock of its own (callers pass ``now``). One table
serves one generation of one job. :meth:`NegotiationTable.submit` is the hot
path of training: it touches only the tensors named in the incoming message,
never the whole table.

A tensor is keyed by ``(process_set_id, name)``. It is *ready* when every rank
of its process set has submitted it; it is then validated across ranks and
turned into a :class:`~hora_coordinator.messages.Response` (a plain dataclass;
:mod:`hora_coordinator.wire` encodes it). Ready allreduces that share a fusion
key are fused up to the job's fusion threshold; the tensors of a grouped
allreduce always go out together in one response.

Process sets other than 0 are registered by :meth:`NegotiationTable.add_process_set`;
a set's collectives order its ranks by the ascending ``ranks`` list (first_dims,
the alltoall matrix) and are answered to its members only. The AddProcessSet
and RemoveProcessSet calls are collectives of every rank:
:meth:`NegotiationTable.call_process_set` gathers them and decides once
(:mod:`.set_calls`).

``hvd.join()``: a rank that sends an ``OP_TYPE_JOIN`` request is *joined*
until every rank of the world has joined. While it is, a tensor is ready once
every non-joined rank of its set submitted it; an allreduce then goes to the
whole set with ``join_fill`` (what the joined ranks need to contribute the
reduction's identity), any other collective fails on its submitters. When the
last rank joins, every rank gets one ``RESPONSE_TYPE_JOIN`` and the joined state
is cleared.

The package's modules, by stage: :mod:`.pending` (what waits), :mod:`.validation`
(do the ranks agree), :mod:`.responses` (answers, fusion), :mod:`.set_calls`
(process set calls gathered from every rank), :mod:`.table` (the table that
ties them together).
"""

from __future__ import annotations

from .pending import PendingTensor, SetMembers, describe_waits, request_nbytes
from .set_calls import NOT_ADDED, SetCall, SetCallKind, SetCallResult, SetCalls
from .table import NegotiationTable, Outcome
from .validation import format_ranks

__all__ = [
    "NOT_ADDED",
    "NegotiationTable",
    "Outcome",
    "PendingTensor",
    "SetCall",
    "SetCallKind",
    "SetCallResult",
    "SetCalls",
    "SetMembers",
    "describe_waits",
    "format_ranks",
    "request_nbytes",
]
