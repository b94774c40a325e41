"""DistributedOptimizer: allreduces gradients from backward hooks as they become ready."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .compression import Compression
from .mpi_ops import (
    Average,
    ProcessSet,
    ReduceOp,
    Sum,
    allreduce_async_,
    global_process_set,
    size,
    synchronize,
)

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`.

    Each parameter gets a post-accumulate-grad hook. When a parameter's
    gradient has accumulated ``backward_passes_per_step`` times, the hook
    starts an in-place allreduce of it; ``step()`` waits for all of them
    and then runs the wrapped optimizer's update.
    """

    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, Any]] | None,
                 compression: Any, backward_passes_per_step: int, op: ReduceOp,
                 gradient_predivide_factor: float, process_set: ProcessSet) -> None:
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._op = op
        self._process_set = process_set
        self._predivide = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step

        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            names = [n for n, _ in named]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"named_parameters has duplicate names: {dupes}")
            by_param = {p: n for n, p in named}
            unnamed = [i for i, p in enumerate(all_params) if p not in by_param]
            if unnamed:
                raise ValueError(
                    f"named_parameters was given but {len(unnamed)} optimizer parameter(s) are "
                    f"not in it (positions {unnamed[:5]}); pass model.named_parameters() of the "
                    f"model whose parameters the optimizer updates")
        else:
            by_param = {}
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    by_param[p] = f"noname.{gi}.{pi}"
        self._names = {p: by_param[p] for p in all_params}
        self._handles: dict[torch.Tensor, tuple[int, Any, torch.Tensor]] = {}
        self._delay = {p: backward_passes_per_step for p in all_params}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = []
        if size() > 1:
            for p in all_params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _allreduce_grad_async(self, p: torch.Tensor) -> None:
        name = f"allreduce.{self._names[p]}"
        compressed, ctx = self._compression.compress(p.grad)
        if self._op == Average:
            pre, post = 1.0 / self._predivide, self._predivide
        else:
            pre, post = 1.0, 1.0
        handle = allreduce_async_(compressed, name=name, op=self._op, prescale_factor=pre,
                                  postscale_factor=post, process_set=self._process_set)
        self._handles[p] = (handle, ctx, compressed)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p in self._handles:
            raise RuntimeError(
                f"gradient of {self._names[p]!r} was computed twice before step(): call "
                f"optimizer.step() or optimizer.synchronize() after each backward pass, or "
                f"raise backward_passes_per_step")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._allreduce_grad_async(p)

    def synchronize(self) -> None:
        """Waits for every gradient allreduce of this step and writes the results back."""
        if size() > 1:
            for p in self._names:
                if p.requires_grad and p not in self._handles:
                    # A parameter unused in this forward pass still takes part,
                    # so that every rank runs the same allreduces.
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    self._allreduce_grad_async(p)
            for p, (handle, ctx, _compressed) in list(self._handles.items()):
                output = synchronize(handle)
                if ctx is not None or output is not p.grad:
                    p.grad.copy_(self._compression.decompress(output, ctx))
                self._delay[p] = self.backward_passes_per_step
        self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Lets ``step()`` skip the synchronize that an explicit ``synchronize()`` already did."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called right after optimizer.synchronize(); wrap it in "
                    "`with optimizer.skip_synchronize():` to avoid a second synchronize",
                    stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients are still being "
                "allreduced")
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
    allreduces each gradient as soon as backward produces it.

    Args:
        optimizer: the optimizer to wrap; its state carries over.
        named_parameters: ``model.named_parameters()``, used to name allreduces.
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, divide by this before the sum
            and by ``size / factor`` after it.
    """
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer supports op=hvd.Average or hvd.Sum, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    del num_groups, groups, sparse_as_dense  # accepted; grouping is the coordinator's fusion
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, process_set)
    wrapped.state.update(optimizer.state)
    return wrapped
