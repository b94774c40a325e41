"""A DistributedOptimizer's gradients as one allreduce, when the model is small.

A model of many small parameters whose gradients total a few MiB (section
2c of bench/README.md: 400 of 16 KiB or 256 B) spends more on the
per-tensor path than on its bytes: each gradient is its own entry, name,
handle, cache slot and view in the fusion buffer. When every gradient of a
step is handed to the engine at ``synchronize()`` anyway (they total less
than the hand-over threshold, so no allreduce starts during the backward
pass), the optimizer allreduces one flat buffer of its own under one name: one
entry instead of hundreds.

When the buffer holds the gradients' own dtype (no compression, or fp16 or
bf16 of a model already in it), the parameters are contiguous and
``HORA_GRADIENT_VIEWS`` is not 0, each gradient is copied in once and then
left as a view of the buffer: ``p.grad`` is that view from then on, as with
DDP's ``gradient_as_bucket_view``, and the reduced values land in it with
no copy back. The optimizer's ``zero_grad()`` zeroes the whole buffer in
one call instead of setting 400 gradients to None, so backward accumulates
into the views and the next step copies nothing. A script that sets a
gradient to something else (a new tensor, None through
``model.zero_grad()``) is followed: that gradient is copied in and made a
view again. A parameter without a gradient in a step gets zeros (its view),
and ``zero_grad()`` sets it to None again, so that the next backward that
uses it makes the gradient it would without hora (a sparse one, for
``Embedding(sparse=True)``: reduced dense in the buffer, it is handed back
sparse on every rank). What a script sees that differs from Horovod's
optimizer: from ``zero_grad()`` to ``synchronize()`` the gradients of the
parameters used in the last step are zeros rather than None (Horovod's
synchronize() hands every parameter a gradient anyway, zeros for one that
had none). Where the reduction adds each element in rank order (the mesh
on one machine, any 2 ranks) the bits are those of one allreduce per
gradient; a Gloo ring's order depends on an element's place in the
buffer, as it did when the engine fused the gradients itself. (On one
machine a buffer of 64 KiB or more moves into /dev/shm after the world's
first step, and its average is divided after the sum rather than as each
rank packs it: the same bits but below the smallest normal float.)

The first step of each world goes gradient by gradient, so that the
coordinator checks every gradient's name, dtype and shape across ranks and
a mismatch fails with the gradient's own name (Horovod's errors); the
steps after it in that world are fused. Every rank decides the same way:
the eligibility depends on the model alone, a world's ranks run its first
step together (after an elastic reset too, when every rank starts a new
world), and a completed join starts the checking over (a rank that joined
early skipped the steps its peers checked). A parameter that changes shape
or dtype after that makes the fused call invalid: every rank gets the
InvalidCallError, and the next step checks every gradient again, refitting
the buffer (so a change made on every rank alike, ``model.half()`` after
training began, costs that one step).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _runtime
from .._ops import ReduceOp
from ..engine import Handle
from ..settings import Settings
from ..world import ProcessSet, check_process_set
from ._collectives import _allreduce_entry
from ._native import hooks_module
from ._notes import PyFusedViews
from ._submission import _enqueue
from ._validation import _reduction_problem
from .compression import Compression

__all__ = ["_FusedGradients", "_gradient_views"]

_UNSET = object()
_DATA_PTR = torch.Tensor.data_ptr


class _FusedGradients:
    """The flat buffer of an optimizer's dense gradients, in parameter order.

    Attributes:
        params: every parameter the optimizer reduces, in its parameter order
            (the same on every rank).
        name: the fused allreduce's name.
        validated: the world (and its count of completed joins) whose last
            step succeeded: the steps after it in that world are fused. None
            before one, and from the start of a fused step until it succeeds
            (a failed step is followed by one that checks every gradient again).
        flat: the wire tensor, every gradient cast to the compression's dtype,
            back to back (None while the parameters do not qualify); its views
            are the gradients when that dtype is theirs.
    """

    __slots__ = ("params", "name", "validated", "flat", "no_contexts", "_views", "_shapes",
                 "_dtype", "_names", "_limit", "_compression", "_as_grads",
                 "_views_wanted", "_view_data", "_loose", "_resparse", "_flags",
                 "_shared_in", "_checked")

    def __init__(self, params: list[torch.Tensor], names: list[str], limit_bytes: int,
                 compression: Any, views: bool) -> None:
        self.params = params
        self._views_wanted = views
        self.name = f"allreduce.fused.{len(params)}.{names[0]}"
        self._names = names
        self.validated: Any = None
        self._limit = limit_bytes
        self._compression = compression
        #: What the compression hands back for each gradient to decompress: nothing.
        self.no_contexts = [None] * len(params)
        self.flat: torch.Tensor | None = None
        # Views of ``flat`` shaped as each parameter was when it was sized.
        self._views: list[torch.Tensor] = []
        self._shapes: list[torch.Size] = []  # theirs
        self._fit()

    @classmethod
    def plan(cls, groups: list[list[torch.Tensor]], names: dict[torch.Tensor, str],
             limit_bytes: int, compression: Any, sparse: bool, views: bool
             ) -> _FusedGradients | None:
        """The fused gradients of an optimizer with these groups, or None when it
        does not qualify: parameters reduced in several groups of the user's
        choosing (one group of them all qualifies), a single parameter,
        parameters of several dtypes or devices, a compression other than none,
        fp16 or bf16, gradients that reach ``limit_bytes`` (the hooks start those
        while backward runs), or ``sparse`` ones (a sparse optimizer's, or
        ``sparse_as_dense``: whether a gradient is sparse can differ from rank
        to rank, and so would the path). ``views``: the gradients may stay
        views of the buffer (``HORA_GRADIENT_VIEWS``)."""
        if sparse:
            return None
        if len(groups) == 1:  # one group of every parameter (Lightning's on CPU)
            params = list(groups[0])
        elif all(len(g) == 1 for g in groups):
            params = [g[0] for g in groups]
        else:
            return None
        if len(params) < 2:
            return None
        fused = cls(params, [names[p] for p in params], limit_bytes, compression, views)
        return fused if fused.flat is not None else None

    def _fit(self) -> None:
        """Sizes the flat buffer for the parameters as they are now."""
        params, first = self.params, self.params[0]
        self._dtype = first.dtype
        wire = _wire_dtype(self._compression, first.dtype)
        self.flat, self._views, self._shapes = None, [], []
        self._view_data: list[int] = []  # where each view's data was made
        # The world whose ranks read ``flat`` in place (a weak reference).
        self._shared_in: weakref.ref[Any] | None = None
        # The views are contiguous: a parameter that is not (a channels_last
        # weight) wants a gradient with its own strides (torch's layout contract).
        self._as_grads = (self._views_wanted and wire == first.dtype
                          and all(p.is_contiguous() for p in params))
        # The checks of the views and of where each parameter's data was when its
        # gradient was last checked (see ``_checks``).
        self._checked: Any = _UNSET
        # The parameters (by index) whose gradient the last step left other
        # than a view: none then (given zeros), or handed back sparse. zero_grad()
        # leaves them as torch does, and the next step takes them back.
        self._loose: list[int] = []
        # This step's sparse gradients here (by index): their sparse_dim (see
        # ``gradients``).
        self._resparse: dict[int, int] = {}
        self._flags: torch.Tensor | None = None
        if wire is None or any(p.dtype != first.dtype or p.device != first.device
                               for p in params):
            return
        numels = [p.numel() for p in params]
        if sum(numels) * first.element_size() >= self._limit:
            return
        # After the gradients, one element per parameter: 1 where this rank's
        # gradient is sparse, reduced with them (see ``gradients``).
        self.flat = torch.zeros(sum(numels) + len(params), dtype=wire, device=first.device)
        self._shapes = [p.shape for p in params]
        self._renew_views()

    def _renew_views(self) -> None:
        """Views of ``flat`` shaped as the parameters were when it was sized."""
        assert self.flat is not None
        numels = [shape.numel() for shape in self._shapes]
        grads, self._flags = self.flat[:sum(numels)], self.flat[sum(numels):]
        self._views = [v.view(shape) for v, shape in
                       zip(grads.split(numels), self._shapes, strict=True)]
        self._view_data = list(map(_DATA_PTR, self._views))
        # New checks for these views; what the last ones saw of the parameters'
        # data holds for them.
        old, self._checked = self._checked, _UNSET
        if old is not _UNSET and old.same_data():
            self._checks().note_data()

    def active(self, runtime: Any) -> bool:
        """Whether a step of ``runtime`` goes as one allreduce: the optimizer
        qualifies, and a step of the same world succeeded before."""
        return self.flat is not None and self.validated == _world(runtime)

    def checked(self, runtime: Any, one_by_one: bool) -> None:
        """A step of ``runtime`` succeeded: the next ones are fused. After a step
        that went gradient by gradient, the buffer is refitted first when a
        parameter changed its shape, dtype or device since it was sized (the
        parameters may then no longer qualify: no step is fused again)."""
        flat = self.flat
        if flat is None:
            return
        if one_by_one and any(p.shape != shape or p.dtype != self._dtype
                              or p.device != flat.device
                              for p, shape in zip(self.params, self._shapes, strict=True)):
            self._fit()
        self.validated = _world(runtime) if self.flat is not None else None
        if self.validated is not None and (self._shared_in is None
                                           or self._shared_in() is not runtime):
            self._share(runtime)

    def _share(self, runtime: Any) -> None:
        """Moves the buffer, once per world, into memory that the world's other
        ranks read in place (when every rank shares this machine's /dev/shm):
        its allreduce then copies nothing into the round's payload, and each
        rank reduces a share of the elements straight into every rank's buffer
        (hora_native/mesh_resident.py; bench/README.md, section 2c). The
        gradients that were views of the old buffer become views of the new
        one, with the same values."""
        self._shared_in = weakref.ref(runtime)
        flat = self.flat
        assert flat is not None
        if flat.device.type != "cpu":
            return
        shared = runtime.engine.shared_zeros(flat.numel(), flat.dtype)
        if shared is None:
            return
        shared.copy_(flat)
        old = self._views
        self.flat = shared
        self._renew_views()
        if self._as_grads:
            for p, was, view in zip(self.params, old, self._views, strict=True):
                if p.grad is was:
                    p.grad = view

    def gradients(self, dense: Callable[[torch.Tensor], torch.Tensor]
                  ) -> tuple[list[torch.Tensor], str | None]:
        """Every parameter's gradient, ``dense(p)`` for one that has none (the
        optimizer's zeros); and what is wrong when a gradient or its parameter
        no longer has the shape or dtype the buffer was sized for. When every
        gradient is its view of the buffer already, the views themselves
        (``_copy_in`` then copies nothing).

        A sparse gradient (of an ``Embedding(sparse=True)`` unused in the
        world's first step: one used there sends every step gradient by
        gradient) is reduced dense with the others, and its flag after them
        says so: every rank hands that gradient back sparse (``_copy_out``).
        Whether it is sparse may differ from rank to rank, and every rank must
        make the same call and get the same gradient."""
        self._resparse = {}
        if self._as_grads and self._checks().same_data():
            # (Parameters given new data, or converted since the last step, are
            # checked below: their gradients no longer fit.)
            if self._views_except(()):
                self._loose = []  # zeroed some other way: as if used
                return self._views, None  # the buffer holds them (see ``_copy_in``)
            if self._views_but_loose():
                return self._views, None
        if self._as_grads and not self._checks().views_in_place():
            # A conversion (``Module._apply``: model.double(), .to(...)) gave the
            # views new storage and kept them as the gradients: new views, and
            # the gradients are copied in.
            self._renew_views()
        grads: list[torch.Tensor] = []
        problem = None
        dtype = self._dtype
        assert self.flat is not None
        device = self.flat.device
        unused = []
        resparse = {}
        for p, shape in zip(self.params, self._shapes, strict=True):
            grad = p.grad
            if grad is None:
                unused.append(len(grads))
                grad = dense(p)
            elif grad.is_sparse:
                resparse[len(grads)] = grad.sparse_dim()
                grad = grad.to_dense()
            if problem is None:
                name = self._names[len(grads)]
                problem = (_changed(name, "gradient", grad, dtype, shape, device)
                           or _changed(name, "parameter", p, dtype, shape, device))
            grads.append(grad)
        if problem is None:
            self._checks().note_data()
            self._loose = unused
        self._resparse = resparse
        return grads, problem

    def start(self, grads: list[torch.Tensor], problem: str | None, op: ReduceOp, pre: float,
              post: float, process_set: ProcessSet) -> Handle:
        """Copies ``grads`` into the flat buffer, cast as the compression casts
        them (those that are its views already stay where they are), and
        starts its allreduce. The results are in the views, which are the
        parameters' gradients, or are copied back into ``grads`` (cast back)
        where the buffer holds another dtype, before its handle completes with
        ``grads``. The caller waits on it at once.

        A ``problem`` (a gradient that no longer fits: its parameter changed on
        this rank) makes the call invalid: every rank gets the InvalidCallError,
        and the next step checks every gradient again.
        """
        flat = self.flat
        assert flat is not None
        self.validated = None  # until the step succeeds
        if problem is None:
            self._copy_in(grads)
            flags = self._flags
            assert flags is not None
            flags.zero_()
            if self._resparse:
                flags[list(self._resparse)] = 1
            problem = _reduction_problem(flat, op, pre, post, "allreduce")
        set_id = check_process_set(process_set)
        entry = _allreduce_entry(flat, self.name, op, pre, post, set_id, waited=True)
        entry.result = functools.partial(self._copy_out, grads)
        return _enqueue(entry, problem)

    def _views_but_loose(self) -> bool:
        """Whether every gradient is its view of the buffer, but for loose ones
        (see ``_loose``) that have none now; those get their view, zeroed
        (Horovod's zeros for a parameter without a gradient)."""
        params = self.params
        still = [i for i in self._loose if params[i].grad is None]
        if not still or not self._views_except(still):
            return False
        for i in still:
            params[i].grad = self._views[i].zero_()
        self._loose = still
        return True

    def _checks(self) -> Any:
        """The checks of this buffer's views, made on first use: in C++
        (:mod:`._native`) where it is built, else their Python twin."""
        if self._checked is _UNSET:
            module = hooks_module()
            kind = PyFusedViews if module is None else module.FusedViews
            self._checked = kind(self.params, self._views, self._shapes, self._view_data)
        return self._checked

    def _views_except(self, loose: Sequence[int]) -> bool:
        """Whether every gradient but those at ``loose`` is its view of the buffer."""
        return bool(self._checks().views_except(sorted(loose)))

    def _copy_in(self, grads: list[torch.Tensor]) -> None:
        """Copies each gradient into its view of the flat buffer, unless it is
        that view already; when the buffer holds the gradients' own dtype, the
        view becomes the parameter's gradient (see ``_copy_out``)."""
        views = self._views
        if grads is views:
            return
        if not self._as_grads:
            torch._foreach_copy_(views, grads)
            return
        stale = [i for i, (grad, view) in enumerate(zip(grads, views, strict=True))
                 if grad is not view]
        if not stale:
            return
        torch._foreach_copy_([views[i] for i in stale], [grads[i] for i in stale])
        params = self.params
        for i in stale:
            params[i].grad = grads[i] = views[i]

    def zero_in_place(self, groups: list[dict[str, Any]], set_to_none: bool) -> bool:
        """Zeroes every gradient at once when each is its view of the buffer,
        the last step succeeded, and every parameter's data is where and as it
        was when its gradient was last checked. Otherwise (a failed step, a
        parameter given new data or converted) the caller sets the gradients
        to None, so that backward makes them anew, shaped as the parameters
        are now, and the next step checks them. So it does when the
        optimizer's ``groups`` hold parameters the buffer does not (frozen
        when it was wrapped, or added since).

        The parameters without a gradient in the last step (an embedding it
        did not use, say), and those it handed back sparse, are left as torch
        leaves them: None (``set_to_none``), so that backward makes the
        gradient it would without hora (a sparse one for
        ``Embedding(sparse=True)``), or zeros."""
        flat, params = self.flat, self.params
        loose = self._loose
        if (flat is None or not self._as_grads or self.validated is None
                or len(params) != sum(len(group["params"]) for group in groups)
                or not self._views_except(loose)
                or not self._checks().same_data() or not self._checks().same_shapes()):
            return False
        flat.zero_()
        views = self._views
        for i in loose:
            p = params[i]
            if set_to_none:
                p.grad = None
            elif p.grad is not None and p.grad is not views[i]:
                p.grad.zero_()  # a sparse one, as torch zeroes it
        return True

    def _copy_out(self, grads: list[torch.Tensor], _reduced: torch.Tensor
                  ) -> list[torch.Tensor]:
        if not self._as_grads:
            torch._foreach_copy_(grads, self._views)
        flags = self._flags
        assert flags is not None
        if flags.any():
            # Sparse on some rank: sparse on every rank (the sparse_dim of this
            # rank's, or an embedding's), with the rows whose sum is not zero.
            reduced = self._views if self._as_grads else grads
            back = flags.nonzero().flatten().tolist()
            for i in back:
                self.params[i].grad = reduced[i].to_sparse(self._resparse.get(i, 1))
            self._loose = list(dict.fromkeys([*self._loose, *back]))
        return grads


def _changed(name: str, what: str, tensor: torch.Tensor, dtype: torch.dtype,
             shape: torch.Size, device: torch.device) -> str | None:
    """What is wrong when ``tensor``, the gradient or the parameter ``name``, no
    longer has the dtype, shape and device the buffer was sized for."""
    if tensor.shape == shape and tensor.dtype == dtype and tensor.device == device:
        return None
    return (f"the {what} of {name!r} is {tensor.dtype} {list(tensor.shape)} on "
            f"{tensor.device}, where the parameter was {dtype} {list(shape)} on {device} "
            f"when the optimizer last checked it")


def _gradient_views() -> bool:
    """``HORA_GRADIENT_VIEWS``: the initialized world's setting, or the
    environment's before ``hvd.init()``."""
    runtime = _runtime._runtime
    return (runtime.settings if runtime is not None else Settings.from_env()).gradient_views


def _world(runtime: Any) -> tuple[Any, int]:
    """What a step's check holds for: its world (the runtime), until a join
    completes there (a rank that joined early skipped the steps its peers
    checked, and every rank counts the join at the same round)."""
    return runtime, runtime.engine.agreement.joins


def _wire_dtype(compression: Any, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype ``compression`` sends gradients of ``dtype`` as, for the built-in
    compressions (stateless, and the same cast for every gradient), asked of
    the compression itself; None for any other."""
    if compression not in (Compression.none, Compression.fp16, Compression.bf16):
        return None
    wire, _ctx = compression.compress(torch.empty(0, dtype=dtype))
    return wire.dtype
