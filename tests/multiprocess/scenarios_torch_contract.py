"""Horovod 0.28.1's PyTorch contract where hora used to differ (run by test_torch_contract.py).

Each function runs on every rank of one job and returns what the test checks.
"""

import torch

import hora.torch as hvd

SAMPLES, BATCH = 23, 2


def sparse_handles():
    """sparse_allreduce_async returns a function that gives the reduced sparse tensor."""
    rank, size = hvd.rank(), hvd.size()
    dense = torch.zeros(6, 3)
    dense[rank] = rank + 1.0
    dense[5] = 1.0  # a row every rank has
    out = {}
    handle = hvd.sparse_allreduce_async(dense.to_sparse(1), name="contract.sparse", op=hvd.Sum)
    out["is_int"] = isinstance(handle, int)
    out["callable"] = callable(handle)
    first = handle()
    out["sum"] = first.to_dense()
    out["again_same"] = handle() is first
    average = hvd.sparse_allreduce_async(dense.to_sparse(1), "contract.sparse.avg", hvd.Average)
    out["average"] = hvd.synchronize(average).to_dense()
    out["polled"] = hvd.poll(average)
    out["size"] = size
    return out


def embedding_batches(size: int, steps: int):
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(0, 12, (steps, 3 * size, 4), generator=gen)
    target = torch.randn(steps, 3 * size, 5, generator=gen)
    return idx, target


def train_sparse_adam(sparse_as_dense: bool, size: int, rank: int, steps: int = 3,
                      distributed: bool = True):
    """SparseAdam over nn.Embedding(sparse=True); one rank's share of each batch."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 5, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.05)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=emb.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
    idx, target = embedding_batches(size, steps)
    share = slice(rank * 3, (rank + 1) * 3) if distributed else slice(None)
    for step in range(steps):
        opt.zero_grad()
        out = emb(idx[step, share]).mean(1)
        torch.nn.functional.mse_loss(out, target[step, share]).backward()
        opt.step()
    return emb.weight.detach().clone()


def process_sets():
    """A set with the ranks of an existing one (or of the global set) is refused."""
    size = hvd.size()
    errors = []
    first = hvd.add_process_set([0, 1] if size > 2 else [0])
    for ranks in ([0, 1] if size > 2 else [0], list(range(size))):
        try:
            hvd.add_process_set(hvd.ProcessSet(list(reversed(ranks))))
        except ValueError as exc:
            errors.append(str(exc))
    # Nothing was lost: the first set, a new one and the global set all work.
    second = hvd.add_process_set([1])
    sums = []
    for pset in (first, second, hvd.global_process_set):
        if pset.included():
            sums.append(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=pset,
                                      name=f"contract.set{pset.process_set_id}").item())
    ids = (first.process_set_id, second.process_set_id)
    removed = hvd.remove_process_set(first)
    again = hvd.add_process_set([0, 1] if size > 2 else [0])  # its ranks are free again
    return {"errors": errors, "sums": sums, "ids": ids, "removed": removed,
            "again": again.process_set_id}


def sampler_epoch(state, batches: int):
    """A 0.28.1 loop: record_batch after each batch, stop after ``batches`` batches."""
    ids = torch.arange(SAMPLES)
    dataset = torch.utils.data.TensorDataset(ids)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
    if state is not None:
        sampler.load_state_dict(state)  # what a reset does in a resized world
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    seen = []
    for batch_idx, (batch,) in enumerate(loader):
        if batch_idx == batches:
            break
        seen.append(batch.tolist())
        sampler.record_batch(batch_idx, BATCH)
    after = sampler.state_dict()
    sampler.set_epoch(sampler.epoch + 1)
    return {"seen": seen, "state": after, "len": len(sampler), "processed_num":
            sampler.processed_num, "next_epoch": list(sampler)}


def contract(sampler_state, sampler_batches):
    size, rank = hvd.size(), hvd.rank()
    return {
        "sparse": sparse_handles(),
        "adam_dense": train_sparse_adam(True, size, rank),
        "adam_sparse": train_sparse_adam(False, size, rank),
        "sets": process_sets(),
        "sampler": sampler_epoch(sampler_state, sampler_batches),
    }


def sampler_through_a_loss(samples: int, kill_step: int):
    """0.28.1's elastic loop at 3 ranks; rank 2 dies after step ``kill_step``, before its commit.

    Returns what every step applied (the allgather of each rank's batch, in
    rank order) as the committed state holds it, and the world sizes seen.
    """
    import os
    import signal

    dataset = torch.utils.data.TensorDataset(torch.arange(samples))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)

    @hvd.elastic.run
    def train(state):
        state.sizes.append(hvd.size())
        for batch_idx, (batch,) in enumerate(loader):
            state.applied.append(hvd.allgather(batch, name="loss.applied").tolist())
            state.sampler.record_batch(batch_idx, BATCH)
            if hvd.rank() == 2 and len(state.applied) == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            state.commit()

    state = hvd.elastic.TorchState(sampler=sampler, applied=[], sizes=[])
    train(state)
    return state.applied, state.sizes, sampler.state_dict()
