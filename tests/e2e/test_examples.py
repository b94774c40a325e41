"""The examples run under horarun / horovodrun at 2 ranks, and Horovod's documented API
works unchanged from a script that only knows Horovod."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def launch(tool, args, timeout=170, env=None):
    return subprocess.run([str(BIN / tool), "-np", "2", sys.executable, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def test_synthetic_benchmark_prints_throughput():
    proc = launch("horarun", ["examples/pytorch_synthetic_benchmark.py", "--num-iters", "2",
                              "--num-batches-per-iter", "2", "--batch-size", "8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"\[0\]<stdout>:Img/sec per worker: [\d.]+", proc.stdout), proc.stdout
    assert re.search(r"Total img/sec on 2 worker\(s\): [\d.]+", proc.stdout)


def test_every_collective_example():
    proc = launch("horarun", ["examples/pytorch_collectives.py"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert f"[{rank}]<stdout>:allreduce Sum: tensor([1., 3., 5., 7.])" in proc.stdout
        assert f"[{rank}]<stdout>:join: last rank to join: 1" in proc.stdout
    assert "allgather (rank r sends r+1 rows): [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]" \
        in proc.stdout


def test_seeds_elastic_train_py_runs_unchanged_under_horovodrun(tmp_path):
    proc = launch("horovodrun", ["examples/elastic/train.py", "--epochs", "1"],
                  env={"OCI__SYNC_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[0]<stdout>:Test set: Average loss:" in proc.stdout
    assert (tmp_path / "artifacts" / "ckpts" / "checkpoint-2.pth.tar").exists()


HOROVOD_SCRIPT = '''
import torch
import horovod.torch as hvd

hvd.init()
torch.manual_seed(hvd.rank())  # different initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16,
                                     backward_passes_per_step=2)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

gen = torch.Generator().manual_seed(100 + hvd.rank())
steps = 3 + hvd.rank()  # uneven data: rank 1 has one more step
for step in range(steps):
    optimizer.zero_grad()
    for micro in range(2):
        loss = model(torch.randn(4, 5, generator=gen)).pow(2).mean()
        loss.backward()
    optimizer.step()
last = hvd.join()
hvd.broadcast_parameters(model.state_dict(), root_rank=last)

hosts = hvd.allgather_object({"rank": hvd.rank()})
assert hosts == [{"rank": r} for r in range(hvd.size())], hosts
try:  # Horovod refuses a set with the global set's ranks
    hvd.add_process_set([0, 1])
except ValueError as exc:
    assert "duplicate process set" in str(exc), exc
else:
    raise AssertionError("a set with the global set's ranks was accepted")
pair = hvd.add_process_set([1])
if pair.included():
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=pair, name="pair")
    assert total.item() == 1.0

flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = hvd.allgather(flat.unsqueeze(0), name="final.params")
print("identical:", bool(torch.equal(gathered[0], gathered[1])), "last:", last)
'''


def test_a_horovod_only_script_ends_with_identical_parameters(tmp_path):
    script = tmp_path / "horovod_script.py"
    script.write_text(HOROVOD_SCRIPT)
    proc = launch("horovodrun", [str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert f"[{rank}]<stdout>:identical: True last: 1" in proc.stdout, proc.stdout
