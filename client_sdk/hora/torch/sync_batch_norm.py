"""Batch normalization over the global batch of every rank (Horovod's SyncBatchNorm)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm"]

# Sums a float tensor over every rank; the name is identical on every rank.
Reducer = Callable[[torch.Tensor, str], torch.Tensor]

# Modules take their ids in construction order, which is the same on every rank
# as long as every rank builds the same model.
_module_ids = itertools.count()


def _allreduce_sum(tensor: torch.Tensor, name: str) -> torch.Tensor:
    from . import mpi_ops

    return mpi_ops.allreduce(tensor, name=name, op=mpi_ops.Sum)


def _channel_sums(t: torch.Tensor) -> torch.Tensor:
    """Per-channel sums in float64 of a (N, C, *) tensor."""
    return t.reshape(t.shape[0], t.shape[1], -1).sum(dim=(0, 2), dtype=torch.float64)


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """Shapes a (C,) vector to broadcast over a (N, C, *) tensor."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalization with global statistics; backward reduces the channel sums it needs."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, factor: float, name: str,
                reduce: Reducer) -> torch.Tensor:
        channels = input.shape[1]
        # Low-precision inputs are normalized in float32 and cast back at the end.
        compute = torch.promote_types(input.dtype, torch.float32)
        x = input.to(compute)
        local_count = input.numel() // channels
        packed = torch.cat([
            torch.tensor([float(local_count)], dtype=torch.float64, device=input.device),
            _channel_sums(x),
            _channel_sums(x * x),
        ])
        total = reduce(packed, name)
        count = float(total[0])
        if count <= 1:
            raise ValueError(f"expected more than 1 value per channel when training, got "
                             f"{int(count)} over all ranks")
        mean64 = total[1:1 + channels] / count
        var64 = (total[1 + channels:] / count - mean64 * mean64).clamp_(min=0)
        invstd64 = torch.rsqrt(var64 + eps)

        if running_mean is not None and running_var is not None:
            unbiased = var64 * (count / (count - 1))
            running_mean.mul_(1 - factor).add_(mean64.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)

        mean = _per_channel(mean64.to(compute), input.dim())
        invstd = _per_channel(invstd64.to(compute), input.dim())
        x_hat = (x - mean) * invstd
        out = x_hat
        if weight is not None:
            out = out * _per_channel(weight.to(compute), input.dim())
        if bias is not None:
            out = out + _per_channel(bias.to(compute), input.dim())

        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.count, ctx.name, ctx.reduce = count, name, reduce
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        compute = mean.dtype
        dy = grad_output.to(compute)
        x_hat = (input.to(compute) - mean) * invstd
        sum_dy = _channel_sums(dy)
        sum_dy_xhat = _channel_sums(dy * x_hat)

        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # The loss is a sum over every rank's outputs, and every output depends on
            # every input through the global statistics: reduce the channel sums.
            channels = input.shape[1]
            total = ctx.reduce(torch.cat([sum_dy, sum_dy_xhat]), f"{ctx.name}.backward")
            mean_dy = _per_channel((total[:channels] / ctx.count).to(compute), input.dim())
            mean_dy_xhat = _per_channel((total[channels:] / ctx.count).to(compute), input.dim())
            scale = invstd
            if weight is not None:
                scale = scale * _per_channel(weight.to(compute), input.dim())
            grad_input = ((dy - mean_dy - x_hat * mean_dy_xhat) * scale).to(input.dtype)
        # The parameters' gradients stay local, as in torch.nn.SyncBatchNorm: the
        # optimizer reduces them with every other gradient.
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization with the statistics of the batch of every rank together.

    In training mode with more than one rank, each rank computes the per-channel
    sum and sum of squares of its input and its element count; one allreduce
    (op ``Sum``) of them gives the global mean and biased variance, which
    normalize the input. Ranks may hold batches of different sizes. The running
    statistics are updated as ``torch.nn.BatchNorm`` does on the global batch
    (``running_var`` with the unbiased variance; ``momentum=None`` gives a
    cumulative moving average). The backward pass reduces the per-channel sums
    of ``grad_output`` and ``grad_output * x_hat``; the gradients of ``weight``
    and ``bias`` stay local to each rank, as with ``torch.nn.SyncBatchNorm``, for
    the optimizer to reduce.

    In eval mode, or with one rank, it is plain batch normalization.

    Every rank must build its ``SyncBatchNorm`` modules in the same order and call
    them in training mode the same number of times: each module takes an id from
    a process-wide counter when built, and its allreduces are named
    ``sync_batch_norm.{id}`` (and ``sync_batch_norm.{id}.backward``). Each is
    waited on before the next starts, so one name per module is enough, and
    the same names every step let the response cache serve them without the
    coordinator.

    Args:
        num_features: the number of channels ``C`` of the ``(N, C, *)`` input.
        eps: added to the variance for numerical stability.
        momentum: the weight of the newest batch in the running statistics, or
            ``None`` for a cumulative moving average.
        affine: whether to learn a per-channel ``weight`` and ``bias``.
        track_running_stats: whether to keep running statistics for eval mode.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self._sync_name = f"sync_batch_norm.{next(_module_ids)}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input of shape (N, C, *), got "
                             f"{input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dim 1, got "
                             f"{input.shape[1]}")
        from . import mpi_ops

        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_buffers = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_buffers else None
        running_var = self.running_var if use_buffers else None
        if not self.training or mpi_ops.size() == 1:
            bn_training = self.training or (self.running_mean is None
                                            and self.running_var is None)
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor, self._sync_name,
                                            _allreduce_sum)
