"""Negotiation for a world of one, inside the trainer's process.

A script started without ``horarun`` is a world of one, as in Horovod. It
needs no coordinator server, but its collectives must still be checked and
answered exactly as the coordinator would: this runs the coordinator's own
negotiation table for one rank, with no thread, socket or store, and
without the coordinator service: the trainer (``hora._solo``) imports this
package directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from hora_negotiation import NegotiationTable, SetCall, SetCallKind, SetCallResult
from hora_proto.v1 import negotiation_pb2 as npb

from .messages import Response
from .wire import response_pb

__all__ = ["LocalNegotiation"]


class LocalNegotiation:
    """The negotiation table of a world of one.

    Args:
        fusion_threshold_bytes: the largest fused allreduce in bytes.
    """

    def __init__(self, fusion_threshold_bytes: int) -> None:
        self._table = NegotiationTable(1, fusion_threshold_bytes)

    def add_process_set(self, process_set_id: int, ranks: Sequence[int], invalid: str = "") -> None:
        """This rank's AddProcessSet, decided at once as the coordinator decides it.

        Raises:
            InvalidRequestError: ``invalid`` was given or the set is refused; the
                message is the one every rank of a larger world would get.
        """
        call = SetCall(SetCallKind.ADD, 0, process_set_id, tuple(ranks), invalid)
        _raise_on_failure(self._table.call_process_set(call, time.monotonic()))

    def remove_process_set(
        self, process_set_id: int, invalid: str = ""
    ) -> list[npb.CoordinatorMessage]:
        """This rank's RemoveProcessSet (``process_set_id`` -1: never added), decided at once.

        Returns:
            The errors of the removed set's pending tensors.

        Raises:
            InvalidRequestError: ``invalid`` was given or the set is 0.
        """
        call = SetCall(SetCallKind.REMOVE, 0, process_set_id, invalid=invalid)
        result = _raise_on_failure(self._table.call_process_set(call, time.monotonic()))
        failed = result.failed.get(0)
        return _messages([failed] if failed else [])

    def submit(self, requests: Iterable[npb.TensorRequest]) -> list[npb.CoordinatorMessage]:
        """The messages the coordinator would send rank 0 for these requests, in order."""
        outcome = self._table.submit(0, requests, time.monotonic())
        lists: list[list[Response]] = []
        if outcome.direct:
            lists.append(list(outcome.direct))
        lists.extend(list(response_list.responses) for _set, response_list in outcome.broadcasts)
        if outcome.targeted.get(0):
            lists.append(outcome.targeted[0])
        return _messages(lists)


def _raise_on_failure(result: SetCallResult | None) -> SetCallResult:
    # A world of one has every rank's call at once: the result is always there.
    assert result is not None
    if result.error is not None:
        raise result.error
    return result


def _messages(lists: list[list[Response]]) -> list[npb.CoordinatorMessage]:
    return [npb.CoordinatorMessage(responses=npb.ResponseList(
                responses=[response_pb(response) for response in responses]))
            for responses in lists]
