"""The Lightning strategy: Lightning's hooks mapped onto hora.torch, and nothing else.

Every collective is a ``hora.torch`` call (allreduce, allgather, barrier,
broadcast_object, DistributedOptimizer), so Lightning training runs on the
same engine as a plain Horovod script: negotiation, fusion, the response
cache and the timeline all apply.

How a training step goes: Lightning's closure runs ``training_step`` and
``backward``; the DistributedOptimizer's gradient hooks start the allreduces
during backward; :meth:`HorovodStrategy.post_backward` waits for them, so
gradient clipping and ``on_before_optimizer_step`` see averaged gradients;
``optimizer.step()`` then runs inside ``skip_synchronize()``. While Lightning
accumulates (``accumulate_grad_batches``), backward passes run under
:meth:`~HorovodStrategy.block_backward_sync` and only the last one reduces.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator, Iterable
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

import hora.torch as hvd

__all__ = ["HorovodStrategy", "register"]

STRATEGY_NAME = "horovod"

# Lightning's reduce ops (strings, or torch.distributed's ReduceOp) -> hora's.
_OPS_BY_NAME = {"mean": hvd.Average, "avg": hvd.Average, "average": hvd.Average,
                "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min, "product": hvd.Product,
                "prod": hvd.Product}


def _reduce_op(reduce_op: Any) -> Any:
    """Lightning's ``reduce_op`` argument as a hora op (``None`` means mean)."""
    if reduce_op is None:
        return hvd.Average
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:
        # torch.distributed.ReduceOp.SUM and friends; AVG exists on NCCL builds only.
        name = next((n.lower() for n in ("SUM", "MAX", "MIN", "PRODUCT", "AVG")
                     if getattr(ReduceOp, n, object()) == reduce_op), "")
    try:
        return _OPS_BY_NAME[name]
    except KeyError:
        raise ValueError(f"hora's Lightning strategy cannot reduce with {reduce_op!r}: use "
                         f"'mean', 'sum', 'max', 'min' or 'product'") from None


def _process_set(group: Any) -> Any:
    """Lightning's ``group`` argument: None (the world) or a ``hvd.ProcessSet``."""
    if group is None or isinstance(group, hvd.ProcessSet):
        return group or hvd.global_process_set
    if group is getattr(torch.distributed.group, "WORLD", object()):
        return hvd.global_process_set
    raise ValueError(f"hora's Lightning strategy reduces over hvd.ProcessSet objects, "
                     f"got group={group!r}")


def _plain(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _has_gradients(optimizer: Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _track_steps(optimizer: Optimizer) -> None:
    """Marks ``optimizer.step()`` calls the way torch's LR schedulers expect.

    A scheduler patches the ``step`` of the optimizer it was built for, and
    warns when it steps before that optimizer did. Its optimizer is replaced
    by the distributed one here, so the distributed one gets the same mark.
    """
    step = optimizer.step

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]


class HorovodStrategy(ParallelStrategy):
    """Data-parallel training over hora, one process per device, started by ``horarun``.

    Each process trains on its share of the data (Lightning adds a
    DistributedSampler with this rank and world size); gradients are
    averaged by ``hvd.DistributedOptimizer``; the model and optimizer state
    are broadcast from rank 0 when ``fit`` starts (the model alone for
    ``validate``, ``test`` and ``predict``). Checkpoints and loggers write
    on rank 0 only; ``self.log(..., sync_dist=True)`` averages across ranks.
    On CUDA each process uses the GPU of its local rank.

    Args:
        accelerator: as for any Lightning strategy (default: Trainer's choice).
        parallel_devices: as for any Lightning strategy (default: Trainer's choice).
        checkpoint_io: as for any Lightning strategy.
        precision_plugin: as for any Lightning strategy.
        compression: ``hvd.Compression.none`` (default), ``fp16`` or ``bf16``
            for the gradient allreduces.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum`` for the gradients.
        gradient_predivide_factor: see ``hvd.DistributedOptimizer``.
        groups: see ``hvd.DistributedOptimizer``: ``N`` reduces the gradients in N
            fused groups, each once all of its gradients are ready; ``0`` reduces
            each gradient as soon as backward produces it. Default: one group on
            CPU (an allreduce overlapping backward takes the cores backward
            needs), each gradient at once on GPUs.
        scale_lr: multiply every learning rate (and the schedulers' base rates)
            by the number of processes when ``fit`` starts, as Lightning 1.x's
            Horovod strategy did. Pass False to keep them as configured.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, *,
                 compression: Any = hvd.Compression.none, op: Any = hvd.Average,
                 gradient_predivide_factor: float = 1.0, groups: Any = "auto",
                 scale_lr: bool = True) -> None:
        hvd.init()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=None, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._groups = groups
        self._scale_lr = scale_lr
        self._sync_blocked = False
        self._skip_sync: contextlib.ExitStack | None = None
        self._set_rank_zero()

    # -- the world -----------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        return hvd.rank()

    @property
    def local_rank(self) -> int:
        return hvd.local_rank()

    @property
    def node_rank(self) -> int:
        return hvd.cross_rank()

    @property
    def world_size(self) -> int:
        return hvd.size()

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this to decide on a DistributedSampler.
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type != "cuda":
            return devices[0]
        if len(devices) > 1:
            return devices[self.local_rank % len(devices)]
        # One process per GPU: the GPU of this process's local rank.
        return torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _set_rank_zero(self) -> None:
        # Loggers, checkpoints and rank_zero_* messages ask these.
        for decorator in (rank_zero_only, utils_rank_zero_only):
            setattr(decorator, "rank", self.global_rank)  # noqa: B010 - an overloaded function

    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_rank_zero()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- fit: broadcast the start, wrap the optimizers ------------------------------

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None
        # Every rank starts from rank 0's weights and buffers, also when only evaluating.
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        optimizers = [_plain(opt) for opt in self.optimizers]
        if self._scale_lr:
            self._scale_learning_rates(optimizers)
        for optimizer in optimizers:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        wrapped = [self._distributed(opt, module, trainer.accumulate_grad_batches)
                   for opt in optimizers]
        for config in self.lr_scheduler_configs:
            for old, new in zip(optimizers, wrapped, strict=True):
                if getattr(config.scheduler, "optimizer", None) is old:
                    config.scheduler.optimizer = new
                    _track_steps(new)
        self.optimizers = wrapped
        # post_backward has synchronized before Lightning clips and steps.
        self._skip_sync = contextlib.ExitStack()
        for optimizer in wrapped:
            self._skip_sync.enter_context(optimizer.skip_synchronize())  # type: ignore[attr-defined]

    def _scale_learning_rates(self, optimizers: Iterable[Optimizer]) -> None:
        size = self.world_size
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * size
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * size
        for config in self.lr_scheduler_configs:
            base_lrs = getattr(config.scheduler, "base_lrs", None)
            if base_lrs is not None:
                config.scheduler.base_lrs = [lr * size for lr in base_lrs]

    def _distributed(self, optimizer: Optimizer, module: torch.nn.Module,
                     passes: int) -> Optimizer:
        if hasattr(optimizer, "skip_synchronize"):
            return optimizer  # configure_optimizers already returned a hvd.DistributedOptimizer
        owned = {p for group in optimizer.param_groups for p in group["params"]}
        named = [(name, p) for name, p in module.named_parameters() if p in owned]
        groups = self._groups
        if groups == "auto":
            groups = 1 if self.root_device.type == "cpu" else None
        return hvd.DistributedOptimizer(
            optimizer, named_parameters=named, compression=self._compression, op=self._op,
            gradient_predivide_factor=self._predivide, groups=groups or None,
            backward_passes_per_step=passes)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # GradientAccumulationScheduler changes accumulate_grad_batches between epochs.
        module = self.lightning_module
        passes = module.trainer.accumulate_grad_batches if module is not None else 1
        for optimizer in self.optimizers:
            if getattr(optimizer, "backward_passes_per_step", passes) != passes:
                optimizer.set_backward_passes_per_step(passes)  # type: ignore[attr-defined]
        super().on_train_batch_start(batch, batch_idx)

    # -- backward -------------------------------------------------------------------

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes that only accumulate: their gradients wait for the last one."""
        self._sync_blocked = True
        try:
            yield None
        finally:
            self._sync_blocked = False

    def post_backward(self, closure_loss: Tensor) -> None:
        if self._sync_blocked:
            return
        for optimizer in self.optimizers:
            # Manual optimization may step one optimizer per backward; the others have no grads.
            if hasattr(optimizer, "synchronize") and _has_gradients(optimizer):
                optimizer.synchronize()

    # -- the collectives Lightning asks for ------------------------------------------

    def reduce(self, tensor: Tensor | Any, group: Any = None,
               reduce_op: ReduceOp | str | None = "mean") -> Tensor | Any:
        """Reduces ``tensor`` over all ranks (``"mean"`` by default); non-tensors pass through."""
        if not isinstance(tensor, Tensor):
            return tensor
        # Lightning validates and tests under torch.inference_mode(); hora.torch's
        # collectives take inference tensors as they are.
        op, process_set = _reduce_op(reduce_op), _process_set(group)
        return hvd.allreduce(tensor, op=op, process_set=process_set)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor`` stacked on a new first dimension, as Lightning's DDP returns it."""
        process_set = _process_set(group)
        grads = contextlib.nullcontext() if sync_grads else torch.no_grad()
        with grads:
            return hvd.allgather(tensor.unsqueeze(0), process_set=process_set)

    def barrier(self, name: str | None = None) -> None:
        hvd.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    # -- the end --------------------------------------------------------------------

    def teardown(self) -> None:
        if self._skip_sync is not None:
            self._skip_sync.close()
            self._skip_sync = None
        for optimizer in self.optimizers:
            # The gradient hooks stay on the parameters otherwise: a later fit of
            # the same model would reduce every gradient twice.
            hooks = getattr(optimizer, "_hooks", None)
            if hooks is not None:
                hooks.remove()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, override=True,
            description="Data-parallel training on hora (Horovod's API), started by horarun")


class _LegacyAcceleratorName:
    """What ``Trainer(accelerator="horovod")`` builds: an error naming Lightning 2's spelling."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _LegacyAcceleratorName:
        raise ValueError(
            "Trainer(accelerator='horovod') is the Lightning 1.x spelling; Lightning 2 names the "
            "way processes train together with strategy=. Write Trainer(strategy='horovod') "
            "(with import hora.lightning), keep accelerator= for the device ('cpu', 'gpu' or "
            "'auto'), and start the script with horarun -np N (or horovodrun -np N).")

    @staticmethod
    def is_available() -> bool:
        return False


def register() -> None:
    """Registers ``strategy="horovod"`` and the error for ``accelerator="horovod"``.

    Runs when ``hora.lightning`` is imported; calling it again is harmless.
    """
    HorovodStrategy.register_strategies(StrategyRegistry)
    AcceleratorRegistry.register(
        STRATEGY_NAME, _LegacyAcceleratorName, override=True,
        description="Lightning 1.x's accelerator='horovod': use strategy='horovod'")
