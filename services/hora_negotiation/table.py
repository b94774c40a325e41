"""The negotiation table of one generation: submissions in, ready responses out.

See the package docstring for the rules; this module keeps the state
(pending tensors, held groups, joined ranks, process sets) and decides when
something is ready. Building the answers is :mod:`.responses`' job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .deliveries import Deliveries
from .errors import InvalidRequestError, RankGoneError
from .messages import ErrorKind, OpType, Response, ResponseList, TensorRequest
from .pending import PendingTensor, SetMembers
from .responses import (
    Ready,
    ReadyError,
    ReadyGroup,
    ReadyJoin,
    ReadyTensor,
    ResponseBuilder,
    error_response,
    respond_group,
    respond_tensor,
)
from .set_calls import (
    NOT_ADDED,
    SetCall,
    SetCallKind,
    SetCallResult,
    SetCalls,
    disagreement,
    show_ranks,
)

__all__ = ["NegotiationTable", "Outcome"]


@dataclass
class Outcome:
    """What one submission (or one removal) decided.

    Attributes:
        broadcasts: Response lists to send, each to every rank of its process set.
        direct: Error responses for the submitting rank only.
        targeted: Error responses for some ranks only, by rank (a collective
            that cannot run because ranks joined fails on its submitters).
        negotiated: Tensor names answered with a collective (not an error),
            plus one per completed join.
        errors: Error responses produced.
    """

    broadcasts: list[tuple[SetMembers, ResponseList]] = field(default_factory=list)
    direct: list[Response] = field(default_factory=list)
    targeted: dict[int, list[Response]] = field(default_factory=dict)
    negotiated: int = 0
    errors: int = 0


@dataclass(eq=False)
class _Group:
    size: int
    held: list[PendingTensor] = field(default_factory=list)


class NegotiationTable:
    """Pending tensors of one generation of one job.

    Args:
        size: World size of the generation (process set 0 is ``range(size)``).
        fusion_threshold_bytes: Largest fused allreduce in bytes; 0 never fuses.
    """

    def __init__(self, size: int, fusion_threshold_bytes: int) -> None:
        self.size = size
        self.process_sets: dict[int, SetMembers] = {0: SetMembers(0, tuple(range(size)))}
        self.pending: dict[tuple[int, str], PendingTensor] = {}
        self.fusion_threshold_bytes = fusion_threshold_bytes
        # Rank -> its pending join request, in join order; empty outside hvd.join().
        self.joined: dict[int, TensorRequest] = {}
        self.last_joined_rank = -1
        self._groups: dict[tuple[int, int], _Group] = {}
        # Process set id -> why its tensors can no longer complete (a rank left).
        self._broken_sets: dict[int, str] = {}
        # Ranks that left, and why (a set added later that holds one is broken at once).
        self._departed: dict[int, str] = {}
        # Ids removed in this generation, with their ranks: a late Add from a rank
        # that had not confirmed yet must not bring the set back.
        self._removed: dict[int, tuple[int, ...]] = {}
        # AddProcessSet / RemoveProcessSet calls waiting for the other ranks.
        self.set_calls = SetCalls(size)
        # The numbered lists each set was sent (re-sent to a rank that missed some).
        self.deliveries = Deliveries()

    # ---- process sets --------------------------------------------------------------

    def add_process_set(self, process_set_id: int, ranks: Sequence[int]) -> bool:
        """Registers set ``process_set_id``; idempotent for the same ranks.

        Returns:
            Whether this call registered it (False: an earlier call did, or
            it was removed already and this is a late confirmation).

        Raises:
            InvalidRequestError: id below 1; ranks empty, unsorted, repeated or
                outside ``[0, size)``; the id is (or was) registered with other ranks.
        """
        if process_set_id < 1:
            raise InvalidRequestError(
                f"process set id must be at least 1 (0 is the global set), got {process_set_id}"
            )
        ranks = tuple(ranks)
        shown = show_ranks(ranks)
        if not ranks:
            raise InvalidRequestError(f"process set {process_set_id} has no ranks")
        if any(not 0 <= r < self.size for r in ranks):
            raise InvalidRequestError(
                f"process set {process_set_id} ranks {shown} must lie in [0, {self.size})"
            )
        if any(a >= b for a, b in zip(ranks, ranks[1:], strict=False)):
            raise InvalidRequestError(
                f"process set {process_set_id} ranks {shown} must be ascending and distinct"
            )
        known = self.process_sets.get(process_set_id)
        earlier = known.ranks if known is not None else self._removed.get(process_set_id)
        if earlier is not None:
            if earlier != ranks:
                was = "was removed in this generation" if known is None else "is registered"
                raise InvalidRequestError(
                    f"process set {process_set_id} {was} with ranks "
                    f"{show_ranks(earlier)}, not {shown}"
                )
            return False
        pset = self.process_sets[process_set_id] = SetMembers(process_set_id, ranks)
        for rank in ranks:
            reason = self._departed.get(rank)
            if reason is not None:
                self._broken_sets.setdefault(pset.id, reason)
                break
        return True

    def call_process_set(self, call: SetCall, now: float) -> SetCallResult | None:
        """Records one rank's AddProcessSet (RemoveProcessSet) call; decides once all ranks called.

        The decision answers every caller alike: the calls fail when some
        rank found a problem with its own call or the ranks named different
        sets (:func:`.set_calls.disagreement`), or when this table refuses the
        set (:meth:`add_process_set`, :meth:`remove_process_set`); otherwise
        the set is registered (removed). A call made once a rank has departed
        can never complete: it fails at once, answering its caller only.

        Returns:
            The result, or None while some rank has not called.
        """
        if self._departed:
            reason = next(iter(self._departed.values()))
            return SetCallResult(
                call.kind,
                (call.rank,),
                RankGoneError(f"{call.kind.value} cannot complete: {reason}"),
                call.process_set_id,
            )
        calls = self.set_calls.gather(call, now)
        if calls is None:
            return None
        callers = tuple(c.rank for c in calls)
        set_id, ranks = calls[0].process_set_id, calls[0].ranks
        problem = disagreement(calls)
        if problem is not None:
            return SetCallResult(call.kind, callers, InvalidRequestError(problem), set_id)
        try:
            if call.kind is SetCallKind.ADD:
                added = self.add_process_set(set_id, ranks)
                return SetCallResult(call.kind, callers, None, set_id, added, ranks)
            if set_id == NOT_ADDED:
                return SetCallResult(call.kind, callers, None, set_id)
            known = set_id in self.process_sets
            failed = self.remove_process_set(set_id)
            return SetCallResult(call.kind, callers, None, set_id, known, failed=failed)
        except InvalidRequestError as exc:
            error = InvalidRequestError(f"{call.kind.value} failed on every rank: {exc}")
            return SetCallResult(call.kind, callers, error, set_id)

    def remove_process_set(self, process_set_id: int) -> dict[int, list[Response]]:
        """Removes a set (idempotent); its pending tensors fail.

        Costs O(pending tensors); removal is rare.

        Returns:
            Error responses to send, by recipient rank: each pending tensor's
            to the ranks that submitted it.

        Raises:
            InvalidRequestError: ``process_set_id`` is 0 (the global set stays).
        """
        if process_set_id == 0:
            raise InvalidRequestError("process set 0 (the global set) cannot be removed")
        pset = self.process_sets.pop(process_set_id, None)
        if pset is None:
            return {}
        self._removed[process_set_id] = pset.ranks
        self._broken_sets.pop(process_set_id, None)
        out: dict[int, list[Response]] = {}

        def fail(tensor: PendingTensor, recipients: Iterable[int]) -> None:
            response = error_response(
                [tensor.name],
                pset.id,
                f"tensor '{tensor.name}': process set {pset.id} was removed",
            )
            for rank in recipients:
                out.setdefault(rank, []).append(response)

        for key in [k for k in self.pending if k[0] == pset.id]:
            tensor = self.pending.pop(key)
            fail(tensor, tensor.submissions)
        for gkey in [k for k in self._groups if k[0] == pset.id]:
            for tensor in self._groups.pop(gkey).held:
                fail(tensor, tensor.submissions)
        return out

    # ---- submissions ---------------------------------------------------------------

    def submit(self, rank: int, requests: Iterable[TensorRequest], now: float) -> Outcome:
        """Records one message's requests from ``rank`` and answers what became ready."""
        ready: list[Ready] = []
        outcome = Outcome()
        for req in requests:
            if req.op_type == OpType.JOIN:
                self._join(rank, req, ready, outcome)
                continue
            pset = self.process_sets.get(req.process_set_id)
            if pset is None:
                outcome.direct.append(
                    error_response(
                        [req.name],
                        req.process_set_id,
                        f"tensor '{req.name}': unknown process set {req.process_set_id}",
                    )
                )
                continue
            if rank not in pset.members:
                outcome.direct.append(
                    error_response(
                        [req.name],
                        pset.id,
                        f"tensor '{req.name}': rank {rank} is not in process set {pset.id}",
                    )
                )
                continue
            key = (pset.id, req.name)
            tensor = self.pending.get(key)
            if tensor is None:
                broken = self._broken_sets.get(pset.id)
                if broken is not None:
                    outcome.direct.append(
                        error_response(
                            [req.name],
                            pset.id,
                            f"tensor '{req.name}' cannot complete: {broken}",
                            ErrorKind.RANK_GONE,
                        )
                    )
                    continue
                tensor = PendingTensor(pset, req.name, now)
                self.pending[key] = tensor
            elif rank in tensor.submissions:
                del self.pending[key]
                ready.append(
                    ReadyError(
                        pset, (req.name,), f"tensor '{req.name}': rank {rank} submitted it twice"
                    )
                )
                continue
            tensor.submissions[rank] = req
            if len(tensor.submissions) == len(pset.ranks) or (
                self.joined and self._complete_with_joined(tensor)
            ):
                del self.pending[key]
                self._became_ready(tensor, ready)
        outcome.errors += len(outcome.direct)
        if ready:
            self._respond(ready, outcome)
        return outcome

    def missing_ranks(self, tensor: PendingTensor) -> list[int]:
        """Ranks of the tensor's set that neither submitted it nor joined, ascending."""
        joined = self.joined
        return [
            r for r in tensor.process_set.ranks if r not in tensor.submissions and r not in joined
        ]

    def _complete_with_joined(self, tensor: PendingTensor) -> bool:
        """Whether every rank of the set that has not submitted has joined. O(joined ranks)."""
        waiting = len(tensor.process_set.ranks) - len(tensor.submissions)
        if waiting > len(self.joined):
            return False
        members, subs = tensor.process_set.members, tensor.submissions
        return waiting == sum(1 for r in self.joined if r in members and r not in subs)

    def _join(
        self, rank: int, req: TensorRequest, ready: list[Ready], outcome: Outcome
    ) -> None:
        """``rank`` joined: mark it, answer what it was the last one missing from.

        Costs O(pending tensors), once per rank per join.
        """
        if req.process_set_id != 0:
            outcome.direct.append(
                error_response(
                    [req.name],
                    req.process_set_id,
                    f"tensor '{req.name}': join runs on process set 0 only, "
                    f"not process set {req.process_set_id}",
                )
            )
            return
        broken = self._broken_sets.get(0)
        if broken is not None:
            outcome.direct.append(
                error_response(
                    [req.name],
                    0,
                    f"tensor '{req.name}' (join) cannot complete: {broken}",
                    ErrorKind.RANK_GONE,
                )
            )
            return
        if rank in self.joined:
            outcome.direct.append(
                error_response(
                    [req.name],
                    0,
                    f"tensor '{req.name}': rank {rank} submitted join twice (it joined as "
                    f"'{self.joined[rank].name}')",
                )
            )
            return
        self.joined[rank] = req
        self.last_joined_rank = rank
        for key, tensor in list(self.pending.items()):
            if (
                rank in tensor.process_set.members
                and rank not in tensor.submissions
                and self._complete_with_joined(tensor)
            ):
                del self.pending[key]
                self._became_ready(tensor, ready)
        if len(self.joined) == self.size:
            ready.append(ReadyJoin(self.process_sets[0], rank))
            self.joined.clear()
            self.last_joined_rank = -1

    def _became_ready(self, tensor: PendingTensor, ready: list[Ready]) -> None:
        first = tensor.first_request()
        if first.group_id == 0 or first.group_size <= 1:
            ready.append(ReadyTensor(tensor))
            return
        # Hold group members until the whole group is ready; then they go as one.
        gkey = (tensor.process_set.id, first.group_id)
        group = self._groups.get(gkey)
        if group is None:
            group = self._groups[gkey] = _Group(first.group_size)
        group.held.append(tensor)
        if len(group.held) >= group.size:
            del self._groups[gkey]
            ready.append(ReadyGroup(tensor.process_set, tuple(group.held)))

    def _respond(self, ready: list[Ready], outcome: Outcome) -> None:
        builders: dict[int, ResponseBuilder] = {}
        for item in ready:
            pset = item.tensor.process_set if isinstance(item, ReadyTensor) else item.process_set
            builder = builders.get(pset.id)
            if builder is None:
                builder = builders[pset.id] = ResponseBuilder(pset, self.fusion_threshold_bytes)
            if isinstance(item, ReadyError):
                builder.error(item.names, item.message)
            elif isinstance(item, ReadyGroup):
                respond_group(item, builder)
            elif isinstance(item, ReadyJoin):
                builder.join(item.last_joined_rank)
            else:
                respond_tensor(item.tensor, builder)
        for builder in builders.values():
            responses = builder.finish()
            if responses:
                outcome.broadcasts.append(
                    (builder.process_set, ResponseList(tuple(responses)))
                )
            for rank, targeted in builder.targeted.items():
                outcome.targeted.setdefault(rank, []).extend(targeted)
            outcome.negotiated += builder.negotiated
            outcome.errors += builder.errors

    # ---- departures ----------------------------------------------------------------

    def depart(self, rank: int, reason: str) -> dict[int, list[Response]]:
        """A rank left for good: fail what waits on it and what will need it.

        Every pending tensor of a set containing ``rank`` that ``rank`` has not
        submitted can never complete; each rank that did submit it gets an
        error ``tensor 'NAME' cannot complete: REASON``. Later first
        submissions in those sets fail at once with the same text. Every
        other rank's pending join fails too (``tensor 'JOIN NAME' (join)
        cannot complete: REASON``), and the joined state is cleared.

        Returns:
            Error responses to send, by recipient rank.
        """
        out: dict[int, list[Response]] = {}
        broken_groups: set[tuple[int, int]] = set()
        self._departed.setdefault(rank, reason)
        for pset in self.process_sets.values():
            if rank in pset.members:
                self._broken_sets.setdefault(pset.id, reason)
        for key, tensor in list(self.pending.items()):
            if rank not in tensor.process_set.members or rank in tensor.submissions:
                continue
            del self.pending[key]
            response = error_response(
                [tensor.name],
                tensor.process_set.id,
                f"tensor '{tensor.name}' cannot complete: {reason}",
                ErrorKind.RANK_GONE,
            )
            for submitter in tensor.submissions:
                out.setdefault(submitter, []).append(response)
            first = next(iter(tensor.submissions.values()))
            if first.group_id:
                broken_groups.add((tensor.process_set.id, first.group_id))
        # Group members already ready everywhere cannot go out without their siblings.
        for gkey in broken_groups:
            group = self._groups.pop(gkey, None)
            if group is None:
                continue
            for tensor in group.held:
                response = error_response(
                    [tensor.name],
                    tensor.process_set.id,
                    f"tensor '{tensor.name}' cannot complete: {reason}",
                    ErrorKind.RANK_GONE,
                )
                for member in tensor.process_set.ranks:
                    if member != rank:
                        out.setdefault(member, []).append(response)
        # Set 0 now holds a departed rank, so the world can never be all joined.
        for joiner, req in self.joined.items():
            if joiner != rank:
                out.setdefault(joiner, []).append(
                    error_response(
                        [req.name],
                        0,
                        f"tensor '{req.name}' (join) cannot complete: {reason}",
                        ErrorKind.RANK_GONE,
                    )
                )
        self.joined.clear()
        self.last_joined_rank = -1
        return out

    def clear(self) -> None:
        """Forgets every pending tensor and join (the generation ended)."""
        self.pending.clear()
        self._groups.clear()
        self.joined.clear()
        self.last_joined_rank = -1
