"""Training over TLS: ``horarun --tls``, and a standalone coordinator with its own certificate."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hora.runner.tls import make_job_certificates

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
HORARUN = [sys.executable, "-m", "hora.runner.launch"]

# A few optimizer steps from different initial weights; each rank prints a digest
# of its final parameters, which must be the same on both.
TRAIN = textwrap.dedent("""
    import hashlib
    import torch
    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(5):
        x = torch.randn(16, 6)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print("params", digest)
""")


def _horarun(args: list[str], tmp_path: Path, timeout: float = 120,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return subprocess.run([*HORARUN, *args, sys.executable, str(script)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _same_params_on_both_ranks(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = dict(re.findall(r"\[(\d)\]<stdout>:params ([0-9a-f]{64})", proc.stdout))
    assert set(digests) == {"0", "1"}, proc.stdout[-3000:]
    assert digests["0"] == digests["1"]


def test_horarun_tls_trains_with_a_ca_of_its_own(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = _horarun(["--tls", "-np", "2"], tmp_path, env={"TMPDIR": str(scratch)})
    _same_params_on_both_ranks(proc)
    assert re.search(r"coordinator gRPC 127\.0\.0\.1:\d+ \(TLS\), HTTP https://127\.0\.0\.1:\d+",
                     proc.stderr), proc.stderr[-3000:]
    # The per-job certificates and key went with the job.
    assert not list(scratch.glob("hora-tls-*"))


def test_horarun_trains_on_a_standalone_tls_coordinator(coordinator_factory, tmp_path):
    certs = make_job_certificates(["127.0.0.1"], directory=tmp_path / "tls")
    coordinator = coordinator_factory("--tls-cert", str(certs.cert_file),
                                      "--tls-key", str(certs.key_file))
    proc = _horarun(["--coordinator", coordinator.grpc_address, "--tls-ca", str(certs.ca_file),
                     "--token", coordinator.token, "-np", "2"], tmp_path)
    _same_params_on_both_ranks(proc)


def test_a_plaintext_worker_cannot_reach_a_tls_coordinator(coordinator_factory, tmp_path):
    certs = make_job_certificates(["127.0.0.1"], directory=tmp_path / "tls")
    coordinator = coordinator_factory("--tls-cert", str(certs.cert_file),
                                      "--tls-key", str(certs.key_file))
    proc = _horarun(["--coordinator", coordinator.grpc_address, "--token", coordinator.token,
                     "-np", "1"], tmp_path, env={"HORA_CONNECT_TIMEOUT": "3"})
    assert proc.returncode != 0
    assert "CoordinatorUnavailableError" in proc.stderr, proc.stderr[-3000:]
    assert "HORA_TLS_CA" in proc.stderr, proc.stderr[-3000:]
    assert coordinator.running()
