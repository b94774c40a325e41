"""A few steps of data-parallel training: what a fuzzed coordinator must still serve."""

import torch

import hora.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x = torch.randn(32, 8) + hvd.rank()
y = x.sum(1, keepdim=True)
for _ in range(5):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
weights = hvd.allgather(model.weight.detach().reshape(1, -1))
assert torch.equal(weights[0], weights[1]), weights  # the ranks stayed in step
print(f"trained rank {hvd.rank()} of {hvd.size()}")
