"""Unchanged Horovod scripts: `horovodrun` and the `horovod` import shim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

SCRIPT = """
import os
import torch
import horovod.torch as hvd
hvd.init()
assert hvd.rank() == int(os.environ["HOROVOD_RANK"]) and hvd.size() == 2
x = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum, name="x")
print("ok", hvd.rank(), x.tolist())
"""


def _run(cmd, env=None, timeout=80):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def test_horovodrun_runs_an_import_horovod_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = _run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable,
                 str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert f"[{rank}]<stdout>:ok {rank} [3.0, 3.0, 3.0]" in proc.stdout


def test_horarun_does_not_offer_horovod_unless_asked(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain = _run([str(BIN / "horarun"), "-np", "2", sys.executable, str(script)])
    assert plain.returncode != 0 and "No module named 'horovod'" in plain.stderr
    compat = _run([str(BIN / "horarun"), "--horovod-compat", "-np", "2", sys.executable,
                   str(script)])
    assert compat.returncode == 0, compat.stderr[-3000:]


def test_a_real_horovod_is_never_shadowed(tmp_path):
    fake = tmp_path / "site" / "horovod"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    proc = _run([str(BIN / "horovodrun"), "-np", "2", sys.executable, "-c", "pass"],
                env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 2
    assert "a real Horovod is installed" in proc.stderr and str(fake) in proc.stderr


SETTINGS_SCRIPT = """
import logging
import os
import horovod.torch as hvd
from hora._runtime import current
hvd.init()
s = current().settings
print("settings", hvd.rank(), s.fusion_threshold, s.cycle_time.total_seconds(),
      s.cache_capacity, s.collective_timeout.total_seconds(),
      s.stall_warning_time.total_seconds(), s.stall_shutdown_time.total_seconds(),
      s.timeline_mark_cycles, s.log_level, s.log_hide_time, s.autotune_max_samples,
      os.environ.get("NCCL_IB_DISABLE"))
logging.getLogger("hora.script").info("info-marker from rank %d", hvd.rank())
hvd.shutdown()
"""

CONFIG_FILE = """
params:
  fusion_threshold_mb: 2
  cycle_time_ms: 3
  cache_capacity: 0
stall_check:
  enabled: false
library_options:
  gloo_timeout_seconds: 77
  num_nccl_streams: 2
logging:
  level: INFO
  with_timestamp: false
"""


def test_horovodrun_flags_and_config_file_reach_the_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SETTINGS_SCRIPT)
    config = tmp_path / "hvd.yaml"
    config.write_text(CONFIG_FILE)
    proc = _run([str(BIN / "horovodrun"), "-np", "2", "--config-file", str(config),
                 "--cycle-time-ms", "4", "--autotune-bayes-opt-max-samples", "6",
                 "--hierarchical-allreduce", "--tcp", "--disable-cache",
                 "-hostfile", str(_hostfile(tmp_path)), "--prefix-output-with-timestamp",
                 "--mpi-threads-disable", sys.executable, str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        # The flag's 4 ms wins over the file's 3 ms; the rest is the file's.
        line = (f"[{rank}]<stdout>:settings {rank} 2097152 0.004 0 77.0 0.0 0.0 False INFO "
                f"True 6 1")
        assert line in proc.stdout, proc.stdout
        assert f"[{rank}]<stderr>:INFO hora.script: info-marker from rank {rank}" in proc.stderr
    # Every line starts with the time, as horovodrun's do.
    assert all(line[:3] in ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
               for line in proc.stdout.splitlines())
    notices = [line for line in proc.stderr.splitlines() if line.startswith("horarun: ignoring")]
    assert len(notices) == 3, proc.stderr
    assert any("--hierarchical-allreduce: hora has no hierarchical allreduce" in n
               for n in notices)
    assert any("library_options.num_nccl_streams" in n for n in notices)
    assert any("--mpi-threads-disable" in n for n in notices)


def _hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("localhost slots=2\n")
    return path


IMPORTS_SCRIPT = """
import threading
import torch
import horovod
import horovod.torch as hvd
from horovod.torch.mpi_ops import allreduce, Sum, size, rank
from horovod.torch.mpi_ops import __all__ as mpi_ops_names
from horovod.torch.compression import Compression
from horovod.torch.elastic.state import TorchState, ObjectState
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.functions import broadcast_object, broadcast_parameters
from horovod.torch.optimizer import DistributedOptimizer
from horovod.torch.sync_batch_norm import SyncBatchNorm
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.common.util import (env, gloo_built, is_iterable, mpi_built, nccl_built,
                                 num_rank_is_power_2, split_list,
                                 get_average_backwards_compatibility_fun)
from horovod.runner.util.threads import execute_function_multithreaded, in_thread, on_event
from horovod.runner import run as runner_run
from horovod.runner.common.util.env import get_env_rank_and_size
import hora.errors

assert horovod.run is not None and runner_run is not None
assert HorovodInternalError is hora.errors.HorovodInternalError
assert HostsUpdatedInterrupt is hora.errors.HostsUpdatedInterrupt
assert set(hvd.mpi_ops.__all__) == set(mpi_ops_names) and "allreduce" in mpi_ops_names
assert gloo_built() and not mpi_built() and nccl_built() in (0,) + (nccl_built(),)
assert split_list([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]] and is_iterable([])
assert num_rank_is_power_2(4) and not num_rank_is_power_2(3)
average = get_average_backwards_compatibility_fun(hvd)
assert average(None, None) is hvd.Average and average(None, False) is hvd.Sum
with env(HORA_TEST_VAR="1"):
    import os
    assert os.environ["HORA_TEST_VAR"] == "1"
assert execute_function_multithreaded(lambda a, b: a + b, [(1, 2), (3, 4)]) == {0: 3, 1: 7}
event = threading.Event()
got = []
on_event(event, got.append, args=("fired",), check_interval_seconds=0.01)
event.set()
in_thread(lambda: None).join(5)

hvd.init()
model = torch.nn.Linear(2, 1)
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                           named_parameters=model.named_parameters(),
                           compression=Compression.fp16)
broadcast_parameters(model.state_dict(), root_rank=0)
state = TorchState(model=model, optimizer=opt, epoch=0)
state.commit()
x = allreduce(torch.ones(2) * (rank() + 1), op=Sum, name="x")
assert get_env_rank_and_size() == (rank(), size())
pair = hvd.add_process_set([0])  # [0, 1] at 2 ranks is the global set: Horovod refuses it
assert hvd._get_process_set_ids_and_ranks() == {0: [0, 1], pair.process_set_id: [0]}
hvd.remove_process_set(pair)
assert hvd.mpi_ops._get_process_set_ids_and_ranks() == {0: [0, 1]}
print("imports-ok", rank(), size(), x.tolist(), broadcast_object("hi", root_rank=0),
      isinstance(SyncBatchNorm(2), torch.nn.Module), len(ElasticSampler(list(range(8)))),
      got)
"""


def test_horovodrun_script_imports_every_horovod_module(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(IMPORTS_SCRIPT)
    proc = _run([str(BIN / "horovodrun"), "-np", "2", sys.executable, str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert f"[{rank}]<stdout>:imports-ok {rank} 2 [3.0, 3.0] hi True 4 ['fired']" \
            in proc.stdout, proc.stdout


RUN_SCRIPT = """
import sys
import horovod
MODE = sys.argv[1]  # pickled with the function, by value

def train(scale, *, offset):
    import horovod.torch as hvd
    import torch
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="t")
    if MODE == "fail" and hvd.rank() == 1:
        raise ValueError("rank one cannot go on")
    return {"rank": hvd.rank(), "value": scale * hvd.rank() + offset, "total": total.item()}

try:
    print("RESULT", horovod.run(train, args=(10,), kwargs={"offset": 1}, np=2))
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
"""


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_horovod_run_returns_every_ranks_result_in_rank_order(tmp_path, mode):
    from hora._compat import shim_path

    script = tmp_path / "driver.py"
    script.write_text(RUN_SCRIPT)
    path = os.pathsep.join([shim_path(), os.environ.get("PYTHONPATH", "")])
    proc = _run([sys.executable, str(script), mode], env={"PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if mode == "ok":
        assert ("RESULT [{'rank': 0, 'value': 1, 'total': 1.0}, "
                "{'rank': 1, 'value': 11, 'total': 1.0}]") in proc.stdout, proc.stderr[-3000:]
    else:
        assert ("RAISED RunFuncError rank 1 failed: ValueError: rank one cannot go on"
                in proc.stdout), proc.stdout + proc.stderr[-3000:]


def test_hora_run_works_without_the_shim():
    import hora

    def square_of_rank():
        import hora.torch as hvd
        hvd.init()
        return hvd.rank() ** 2

    assert hora.run(square_of_rank, np=2) == [0, 1]
