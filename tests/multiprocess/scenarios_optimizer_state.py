"""Worker functions for DistributedOptimizer and state helpers, the way Horovod's suite uses them.

Run by tests/multiprocess/test_optimizer_state.py through tests/support/workers.py.
"""

from __future__ import annotations

import warnings

import torch

import hora.torch as hvd


class NoGrad(torch.nn.Module):
    """A model with an integer parameter that never has a gradient (Horovod's own case)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = torch.nn.Parameter(torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.b, 0, self.a.long()) * x


def state_without_gradients():
    """broadcast_optimizer_state on a new optimizer whose parameters have no gradients."""
    torch.manual_seed(hvd.rank())
    out = {}
    model = NoGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                          nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    out["grad"] = grad.clone()
    out["grad_broadcast"] = hvd.broadcast(grad, root_rank=0)
    out["frozen_grad_is_none"] = opt.param_groups[0]["params"][0].grad is None
    out["state_keys"] = sorted(opt.state_dict()["state"])
    # The optimizer trains afterwards.
    opt.zero_grad()
    model(torch.ones(2)).sum().backward()
    opt.step()
    out["b"] = model.b.detach().clone()

    # model= (Horovod 0.28's keyword), a mixed dense and sparse model, and a
    # frozen layer: state exists everywhere and equals rank 0's.
    torch.manual_seed(0)
    mixed = torch.nn.ModuleDict({"emb": torch.nn.Embedding(6, 3, sparse=True),
                                 "lin": torch.nn.Linear(3, 2), "frozen": torch.nn.Linear(2, 2)})
    mixed["frozen"].requires_grad_(False)
    sgd = torch.optim.SGD(mixed.parameters(), lr=0.1 * (hvd.rank() + 1), momentum=0.5)
    hvd.broadcast_optimizer_state(sgd, root_rank=0, model=mixed)
    out["mixed_lr"] = sgd.param_groups[0]["lr"]
    out["mixed_lr_type"] = type(sgd.param_groups[0]["lr"]).__name__
    out["mixed_emb_grad_sparse"] = mixed["emb"].weight.grad.is_sparse
    out["mixed_frozen_grad_is_none"] = mixed["frozen"].weight.grad is None
    out["mixed_state"] = {k: sorted(v) for k, v in sgd.state_dict()["state"].items()}
    return out


def parameter_names_without_named_parameters():
    """Horovod's allreduce.noname.{group}.{index} names, over several param groups."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": model[1].parameters(), "lr": 0.01}], lr=0.1)
    opt = hvd.DistributedOptimizer(opt)
    names = [opt._parameter_names[p] for group in opt.param_groups for p in group["params"]]
    opt.zero_grad()
    model(torch.full((2, 3), float(hvd.rank() + 1))).sum().backward()
    opt.step()
    return names, {k: v.clone() for k, v in model.state_dict().items()}


def sparse_adam(groups):
    """SparseAdam over two sparse embeddings, one of them unused at step 1."""
    torch.manual_seed(0)
    first = torch.nn.Embedding(10, 3, sparse=True)
    second = torch.nn.Embedding(10, 3, sparse=True)
    params = list(first.parameters()) + list(second.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(params, lr=0.1), groups=groups)
    kinds = []
    for step in range(3):
        opt.zero_grad()
        idx = torch.tensor([hvd.rank(), 5, step])
        loss = first(idx).sum() + (second(idx).sum() if step != 1 else 0)
        loss.backward()
        opt.step()
        kinds.append([p.grad.is_sparse for p in params])
    return kinds, first.weight.detach().clone(), second.weight.detach().clone()


def step_after_synchronize_warns():
    """Horovod's warning text for step() right after synchronize(), and none inside skip."""
    model = torch.nn.Linear(1, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    out = {}
    for skip in (False, True):
        opt.zero_grad()
        model(torch.zeros(1, 1)).sub(1).pow(2).mean().backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        out[skip] = [str(w.message) for w in caught]
    opt.set_backward_passes_per_step(2)
    for _ in range(2):
        model(torch.ones(1, 1)).sum().backward()
    opt.step()
    out["weight"] = model.weight.detach().clone()
    return out
