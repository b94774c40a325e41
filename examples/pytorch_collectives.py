"""Every hora collective once, with what each rank gets back.

    horarun -np 2 python examples/pytorch_collectives.py

Each call prints its result on every rank (prefixed by horarun with the
rank), and checks it against what the call promises.
"""

import torch

import hora.torch as hvd


def show(what, value):
    print(f"{what}: {value}", flush=True)


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = torch.arange(4.0) + rank

    total = hvd.allreduce(x, op=hvd.Sum, name="sum")
    show("allreduce Sum", total)
    assert torch.equal(total, sum(torch.arange(4.0) + r for r in range(size)))
    show("allreduce Average", hvd.allreduce(x, name="avg"))
    show("allreduce Max", hvd.allreduce(x, op=hvd.Max, name="max"))
    show("allreduce Sum, prescale 0.5", hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5,
                                                      name="pre"))
    y = x.clone()
    hvd.allreduce_(y, op=hvd.Min, name="min_")
    show("allreduce_ Min (in place)", y)

    handle = hvd.allreduce_async(x, op=hvd.Product, name="prod")
    while not hvd.poll(handle):
        pass
    show("allreduce_async Product", hvd.synchronize(handle))

    show("grouped_allreduce", hvd.grouped_allreduce([x, x * 10], op=hvd.Sum, name="group"))

    ragged = torch.full((rank + 1, 2), float(rank))
    gathered = hvd.allgather(ragged, name="gather")
    show("allgather (rank r sends r+1 rows)", gathered.tolist())
    assert gathered.shape[0] == size * (size + 1) // 2

    root = size - 1
    show(f"broadcast from rank {root}", hvd.broadcast(x, root_rank=root, name="bcast"))

    splits = [1] * size
    sent = torch.arange(float(size)) + 100 * rank
    received, received_splits = hvd.alltoall(sent, splits=splits, name="a2a")
    show("alltoall", (received, received_splits))

    show("reducescatter Sum", hvd.reducescatter(torch.ones(2 * size, 2) * (rank + 1),
                                                op=hvd.Sum, name="rs"))
    show("adasum allreduce", hvd.allreduce(x + 1, op=hvd.Adasum, name="adasum"))

    show("broadcast_object", hvd.broadcast_object({"from": rank, "msg": "hi"}, root_rank=0))
    show("allgather_object", hvd.allgather_object(("rank", rank)))

    if size > 1:
        # Ranks [0, 1], or [0] in a world of 2: a set may not have the global set's ranks.
        ranks = [0, 1] if size > 2 else [0]
        first = hvd.add_process_set(ranks)
        if first.included():
            show(f"allreduce in process set {ranks}",
                 hvd.allreduce(x, op=hvd.Sum, name="ps", process_set=first))
        hvd.remove_process_set(first)

    hvd.barrier()
    for step in range(rank + 1):  # uneven work: rank r does r + 1 steps
        hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"uneven.{step}")
    show("join: last rank to join", hvd.join())
    hvd.shutdown()


if __name__ == "__main__":
    main()
