"""DistributedOptimizer: allreduces gradients from backward hooks as they become ready."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .. import _runtime
from ..engine.telemetry import TELEMETRY
from ..errors import GradientComputedAgainError, HoraError
from ..world import take, wait
from ._adasum_optimizer import _DistributedAdasumOptimizer
from ._collectives import allreduce_gradient_async_, allreduce_gradients_async_
from ._fused import _FusedGradients, _gradient_views
from ._gradient_hooks import _computed_again, _GradientHooks
from ._optimizer_step import (
    _HANDED_OVER,
    HANDOVER_BYTES,
    _complete_sparse,
    _gather_sparse,
    _Pending,
    _Slot,
    _wait_out,
)
from ._parameters import _parameter_groups, _parameter_names
from ._submission import _Group
from .compression import Compression
from .mpi_ops import (
    Adasum,
    Average,
    ProcessSet,
    ReduceOp,
    Sum,
    global_process_set,
    grouped_allreduce_async_,
)

__all__ = ["DistributedOptimizer", "HANDOVER_BYTES"]


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`.

    Each parameter gets a post-accumulate-grad hook. When a parameter's
    gradient has accumulated ``backward_passes_per_step`` times, the hook
    notes it for an in-place allreduce, submitted with the others noted once
    they hold ``HANDOVER_BYTES`` (or of its whole group, once every gradient
    of the group is ready); ``step()`` submits what is left, waits for all of
    them and then runs the wrapped optimizer's update (the hooks of steps that
    go as one allreduce only note: :mod:`._gradient_hooks`).

    The bookkeeping of a step in progress (handles, the gradients each group
    still waits for, delay counters) belongs to the world (runtime) it was
    made in. An elastic reset, or ``shutdown()`` and ``init()``, joins a new
    world: whatever the old world left in flight can never complete, so the
    first call in the new world (a gradient hook, ``zero_grad``,
    ``synchronize`` or ``step``) drops it and the retried step starts clean.
    Checking the world at the point of use, instead of relying on a reset
    callback, covers every way a world ends and every optimizer, also those
    not held by a TorchState.
    """

    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, Any]] | None,
                 compression: Any, backward_passes_per_step: int, op: ReduceOp,
                 gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                 process_set: ProcessSet) -> None:
        # The user's optimizer class comes next in the dynamic class's MRO.
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        self._compression = compression
        self._op = op
        self._process_set = process_set
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step

        all_params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _parameter_names(self.param_groups, all_params, named_parameters)
        self._names = self._parameter_names
        # Parameters whose gradients are sparse (an nn.Embedding(sparse=True)):
        # every one of SparseAdam's, and any seen with a sparse gradient.
        self._sparse = set(all_params) if isinstance(self, torch.optim.SparseAdam) else set()
        self._groups = _parameter_groups([p for p in all_params if p.requires_grad], groups)
        self._slot = {p: _Slot(p, gi, self._names[p], backward_passes_per_step)
                      for gi, members in enumerate(self._groups) for p in members}
        self._group_slots = [[self._slot[p] for p in members] for members in self._groups]
        self._group_sizes = [len(members) for members in self._groups]
        # Each group's gradients not ready yet this step.
        self._unready = self._group_sizes.copy()
        # A small model's gradients, allreduced as one from each world's second step on.
        self._fused = _FusedGradients.plan(
            self._groups, self._names, HANDOVER_BYTES, compression,
            sparse=sparse_as_dense or isinstance(self, torch.optim.SparseAdam),
            views=_gradient_views())
        # The allreduces in flight this step, in the order they started.
        self._pending: list[_Pending] = []
        # Gradients the hooks noted and not submitted yet, in order, and their bytes.
        self._handed: list[_Slot] = []
        self._handed_bytes = 0
        # Sparse gradients reduced dense this step (sparse_as_dense): their sparse_dim.
        self._densified: dict[torch.Tensor, int] = {}
        self._synchronized = False
        self._should_synchronize = True
        # The runtime whose collectives the step in progress waits on (None: no step).
        self._step_runtime: Any = None
        self._hooks = _GradientHooks(self)
        if process_set.size() > 1:
            self._hooks.arm(None)

    # -- the step in progress -------------------------------------------------

    def _reset_step(self) -> None:
        """Forgets the step in progress: handles, group counts, delay counters."""
        passes = self.backward_passes_per_step
        for slot in self._slot.values():  # no lookup keyed by a tensor: its hash is a call
            slot.pending = None
            slot.delay = passes
        self._pending.clear()
        self._handed.clear()
        self._hooks.reset()
        self._handed_bytes = 0
        self._unready = self._group_sizes.copy()
        self._densified.clear()
        self._synchronized = False
        self._step_runtime = None

    def _drop_stale_step(self) -> None:
        """Drops a step begun in a world that has ended (elastic reset, shutdown)."""
        # (Noted gradients and no step begun: the notes' world, _GradientHooks.world.)
        begun = self._step_runtime if self._step_runtime is not None else self._hooks.world()
        if begun is not None and begun is not _runtime._runtime:
            self._reset_step()

    def _begin_step(self) -> None:
        self._drop_stale_step()
        if self._step_runtime is None:
            self._step_runtime = _runtime.current()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Restoring a saved state (TorchState.restore, a checkpoint) starts from
        # a step boundary, like Horovod's: nothing of a step in progress survives.
        self._reset_step()
        super(self.__class__, self).load_state_dict(state_dict)

    # -- submitting ------------------------------------------------------------

    def _scales(self) -> tuple[float, float]:
        if self._op == Average:
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0

    def _dense_grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            # A parameter unused in this forward pass still takes part, so
            # that every rank runs the same allreduces.
            p.grad = torch.zeros_like(p)
            if self._sparse_as_dense and p in self._sparse:
                self._densified[p] = 1
        elif p.grad.is_sparse and self._sparse_as_dense:
            # Reduced dense, handed back sparse (as Horovod does): an optimizer
            # such as SparseAdam takes sparse gradients only.
            self._sparse.add(p)
            self._densified[p] = p.grad.sparse_dim()
            p.grad = p.grad.to_dense()
        return p.grad

    def _is_sparse(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient travels as indices and values (see ``_submit_sparse``)."""
        if self._sparse_as_dense:
            return False
        if p.grad is not None and p.grad.is_sparse:
            self._sparse.add(p)
            return True
        return p.grad is None and p in self._sparse

    def _submit_one(self, slot: _Slot, compressed: tuple[Any, Any] | None = None) -> None:
        """A gradient of its own group; ``compressed``: its (wire tensor, context),
        when the compression has run already."""
        p = slot.param
        grad = p.grad
        if grad is None or grad.is_sparse or (self._sparse and p in self._sparse):
            self._submit([p])
            return
        wire, ctx = compressed if compressed is not None else self._compression.compress(grad)
        pre, post = self._scales()
        handle = allreduce_gradient_async_(wire, slot.wire_name, self._op, pre, post,
                                           self._process_set)
        slot.pending = pending = _Pending([p], handle, [ctx], [wire])
        self._pending.append(pending)

    def _submit(self, params: list[torch.Tensor]) -> None:
        # Sparse gradients leave their group: they are gathered, not reduced.
        dense = []
        for p in params:
            if self._is_sparse(p):
                self._submit_sparse(p)
            else:
                dense.append(p)
        if not dense:
            return
        params = dense
        grads = [self._dense_grad(p) for p in params]
        pairs = [self._compression.compress(g) for g in grads]
        wire = [w for w, _ in pairs]
        pre, post = self._scales()
        if len(params) == 1:
            handle: Any = allreduce_gradient_async_(wire[0], self._slot[params[0]].wire_name,
                                                    self._op, pre, post, self._process_set)
        else:
            handle = take(grouped_allreduce_async_(
                wire, name=f"allreduce.group.{self._names[params[0]]}", op=self._op,
                prescale_factor=pre, postscale_factor=post, process_set=self._process_set))
        pending = _Pending(params, handle, [c for _, c in pairs], wire)
        self._pending.append(pending)
        for p in params:
            self._slot[p].pending = pending

    def _submit_sparse(self, p: torch.Tensor) -> None:
        pending = _gather_sparse(p, self._names[p], self._process_set)
        self._pending.append(pending)
        self._slot[p].pending = pending

    def _on_grad(self, slot: _Slot, p: torch.Tensor) -> None:
        if self._step_runtime is None or self._step_runtime is not _runtime._runtime:
            self._begin_step()  # raises NotInitializedError outside a world
        if slot.pending is not None:
            raise GradientComputedAgainError(
                _computed_again(self._names[p], self.backward_passes_per_step))
        slot.delay -= 1
        if slot.delay:  # passes left; or below 0: computed again, its group not complete
            return
        gi = slot.group
        left = self._unready[gi] - 1
        if left:
            self._unready[gi] = left
            return
        self._unready[gi] = size = self._group_sizes[gi]
        if size == 1:
            slot.pending = _HANDED_OVER
            self._handed.append(slot)
            self._handed_bytes += slot.nbytes
            if self._handed_bytes >= HANDOVER_BYTES:
                self._submit_handed()
            return
        if self._fuses():
            # The group is every gradient, and synchronize() sends them as one.
            slots = self._group_slots[gi]
            for member in slots:
                member.pending = _HANDED_OVER
            self._handed.extend(slots)
            return
        self._submit(list(self._groups[gi]))

    def _submit_handed(self) -> None:
        """Submits the gradients the hooks noted, in the order they came: the
        dense ones in one call to the engine (:meth:`_submit_batch`), unless one
        of them would fail, and then one by one.

        A submission that raises leaves the rest unsubmitted and free:
        ``synchronize()`` submits them as it does the gradients of unused parameters.
        """
        self._hooks.hand_over()
        handed, self._handed[:] = self._handed[:], []  # (the hooks hold the list)
        self._handed_bytes = 0
        for slot in handed:
            slot.pending = None
        if len(handed) > 1 and not self._sparse:
            batch = []
            for slot in handed:
                grad = slot.param.grad
                if grad is None or grad.is_sparse:
                    self._submit_one(slot)
                else:
                    batch.append(slot)
            refused = self._submit_batch(batch)
            if refused is not None:
                # One by one, each compressed once only (a compression may keep state).
                for slot, compressed in zip(batch, refused, strict=True):
                    self._submit_one(slot, compressed)
            return
        for slot in handed:
            self._submit_one(slot)

    def _submit_batch(self, slots: list[_Slot]) -> list[tuple[Any, Any]] | None:
        """Submits the dense gradients of ``slots`` in one call to the engine, each
        under its own name, waited as one. When one of them would fail, submits
        nothing and returns every gradient's (wire tensor, context): they go one
        by one then, to fail as one does."""
        if not slots:
            return None
        compress = self._compression.compress
        pairs = [compress(slot.param.grad) for slot in slots]
        wire = [w for w, _ in pairs]
        pre, post = self._scales()
        handles = allreduce_gradients_async_(wire, [slot.wire_name for slot in slots], self._op,
                                             pre, post, self._process_set)
        if handles is None:
            return pairs
        pending = _Pending([slot.param for slot in slots], _Group(handles),
                           [c for _, c in pairs], wire)
        self._pending.append(pending)
        for slot in slots:
            slot.pending = pending
        return None

    # -- completing -------------------------------------------------------------

    def synchronize(self) -> None:
        """Waits for every gradient allreduce of this step and writes the results back.

        When one fails (an invalid call, ranks that disagree), the others are
        waited out all the same, so that their names leave the engine, and the
        step is forgotten: the error goes up, and the next step starts clean.
        """
        self._drop_stale_step()
        self._hooks.check()  # a gradient noted twice raises, and the step is forgotten
        first = self._hooks.first()
        try:
            self._synchronize()
        except HoraError:
            _wait_out(self._pending)
            self._reset_step()
            raise
        self._reset_step()
        self._synchronized = True
        self._hooks.after_step(first)

    def _synchronize(self) -> None:
        several = self._process_set.size() > 1
        if several:
            self._begin_step()
        fused = several and self._submit_fused()
        if not fused:
            if self._handed or self._hooks.noted:
                self._submit_handed()
            if several:
                for gi, slots in enumerate(self._group_slots):
                    if not any(slot.pending is not None for slot in slots):
                        self._unready[gi] = self._group_sizes[gi]
                        self._submit(list(self._groups[gi]))
        # Also in a world of one (an elastic job that shrank): the hooks may
        # have started allreduces, which are waited for, not left behind.
        for pending in self._pending:
            self._complete(pending)
        if several and self._fused is not None and not self._sparse:
            self._fused.checked(self._step_runtime, one_by_one=not fused)

    def _fuses(self) -> bool:
        """Whether this step's gradients go as one allreduce (:mod:`._fused`)."""
        fused = self._fused
        return fused is not None and not self._sparse and fused.active(self._step_runtime)

    def _submit_fused(self) -> bool:
        """Submits every gradient as one allreduce (:mod:`._fused`) when this
        optimizer qualifies and its world's first step has been checked
        gradient by gradient; False, with nothing submitted, otherwise."""
        fused = self._fused
        if self._pending or not self._fuses():
            return False
        assert fused is not None
        grads, problem = fused.gradients(self._dense_grad)
        pre, post = self._scales()
        handle = fused.start(grads, problem, self._op, pre, post, self._process_set)
        self._pending.append(_Pending(fused.params, handle, fused.no_contexts, grads))
        return True

    def _complete(self, pending: _Pending) -> None:
        if pending.sparse:
            _complete_sparse(pending, self._op == Average, self._process_set.size())
            return
        outputs = wait(pending.handle)
        if outputs is pending.wire:
            return  # written back in place already (a fused step's copy-back)
        if not isinstance(outputs, list):
            outputs = [outputs]
        for p, out, ctx in zip(pending.params, outputs, pending.ctxs, strict=True):
            if ctx is not None or out is not p.grad:
                assert p.grad is not None
                p.grad.copy_(self._compression.decompress(out, ctx))
            if not self._densified:
                continue
            sparse_dim = self._densified.pop(p, None)
            if sparse_dim is not None:
                assert p.grad is not None
                p.grad = p.grad.to_sparse(sparse_dim)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Lets ``step()`` skip the synchronize that an explicit ``synchronize()`` already did."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _local_step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's update alone, with no collective."""
        return super(self.__class__, self).step(closure)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Changes how many backward passes accumulate locally before each allreduce."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        for slot in self._slot.values():
            slot.delay = passes
        self._hooks.after_step(None)  # counting hooks, unless passes == 1

    def step(self, closure: Any = None) -> Any:
        self._drop_stale_step()
        if self._should_synchronize:
            if self._synchronized:
                # Horovod's wording, which scripts and tests match on.
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(). This can cause training slowdown. You may "
                    "want to consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        elif self._pending or self._handed or self._hooks.noted:
            raise RuntimeError(
                f"optimizer.step() inside skip_synchronize() with "
                f"{len(self._pending) + len(self._handed) + len(self._hooks.noted)} gradient "
                f"allreduce(s) still outstanding; call optimizer.synchronize() first")
        self._synchronized = False
        loss = super(self.__class__, self).step(closure)
        TELEMETRY.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._drop_stale_step()
        if self._pending or self._handed or self._hooks.noted:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition: the gradients are still being allreduced")
        self._hooks.noted.refresh()  # (before the forward pass that follows, usually)
        if self._fused is not None and self._fused.zero_in_place(self.param_groups, set_to_none):
            return None  # every gradient is a view of its buffer: zeroed in one call
        return super(self.__class__, self).zero_grad(set_to_none)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[tuple[str, Any]] | None = None,
                         compression: Any = Compression.none,
                         backward_passes_per_step: int = 1,
                         op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    The returned object is an instance of the user's optimizer class (so
    isinstance checks and learning-rate schedulers keep working) that also
    allreduces the gradients while backward runs: the hooks hand them over
    every ``HANDOVER_BYTES`` (4 MiB) of gradients, and the rest at ``synchronize()``.

    Args:
        optimizer: the optimizer to wrap; its state carries over.
        named_parameters: ``model.named_parameters()``, used to name allreduces.
        compression: ``hvd.Compression.none``, ``fp16`` or ``bf16``.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        gradient_predivide_factor: with Average, divide by this before the sum
            and by ``size / factor`` after it.
        num_groups: deprecated spelling of ``groups=N``.
        groups: ``N`` to reduce the parameters in N fused groups, or a list of
            lists of parameters to reduce together.
        sparse_as_dense: reduce sparse gradients as dense tensors instead of
            gathering their nonzeros.
        process_set: the ranks that train together.
    """
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer supports op=hvd.Average, hvd.Sum or hvd.Adasum, "
                         f"got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    if num_groups and groups is not None:
        raise ValueError("pass groups= or the deprecated num_groups=, not both")
    groups = groups if groups is not None else (num_groups or None)
    if op == Adasum:
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                   dict(_DistributedAdasumOptimizer.__dict__))
        wrapped = cls(optimizer.param_groups, named_parameters, compression,
                      backward_passes_per_step, process_set)
    else:
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                   dict(_DistributedOptimizer.__dict__))
        wrapped = cls(optimizer.param_groups, named_parameters, compression,
                      backward_passes_per_step, op, gradient_predivide_factor, groups,
                      sparse_as_dense, process_set)
    wrapped.state.update(optimizer.state)
    return wrapped
