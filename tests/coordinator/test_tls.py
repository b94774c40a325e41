"""A coordinator serving TLS (--tls-cert/--tls-key): gRPC and HTTPS, and what it refuses."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from coordinator_clients import Client, new_job_id
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hora.runner.tls import JobCertificates, make_job_certificates

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


@pytest.fixture
def certs(tmp_path: Path) -> JobCertificates:
    return make_job_certificates(["127.0.0.1"], directory=tmp_path / "tls")


@pytest.fixture
def tls_coordinator(coordinator_factory, certs):
    return coordinator_factory("--tls-cert", str(certs.cert_file), "--tls-key",
                               str(certs.key_file))


def _credentials(certs: JobCertificates) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=certs.ca_pem)


def _https(coordinator, certs: JobCertificates) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    return httpx.Client(base_url=f"https://127.0.0.1:{coordinator.http_port}", verify=context,
                        timeout=5)


def _tls_works(coordinator, certs: JobCertificates) -> None:
    client = Client(coordinator.grpc_address, coordinator.token, _credentials(certs))
    try:
        job = new_job_id()
        (view,) = client.join_all(job, 1)
        assert view.size == 1
    finally:
        client.close()
    with _https(coordinator, certs) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        assert job in http.get("/api/v1/jobs").text


def test_grpc_and_http_serve_over_tls(tls_coordinator, certs):
    _tls_works(tls_coordinator, certs)
    assert "HTTP on https://127.0.0.1:" in tls_coordinator.log()


def test_plaintext_clients_are_refused_and_the_coordinator_stays_healthy(tls_coordinator,
                                                                          certs):
    with grpc.insecure_channel(tls_coordinator.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                     grpc.StatusCode.DEADLINE_EXCEEDED)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{tls_coordinator.http_port}/healthz", timeout=3)
    assert tls_coordinator.running()
    _tls_works(tls_coordinator, certs)


def test_a_client_trusting_another_ca_is_refused(tls_coordinator, tmp_path):
    stranger = make_job_certificates(["127.0.0.1"], directory=tmp_path / "other")
    client = Client(tls_coordinator.grpc_address, tls_coordinator.token, _credentials(stranger))
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.join_all(new_job_id(), 1)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        _https(tls_coordinator, stranger).get("/healthz")


def _coordinator(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hora_coordinator", "--token", "t", *args],
                          capture_output=True, text=True, timeout=30)


def test_a_missing_certificate_file_is_a_clear_error(certs, tmp_path):
    missing = tmp_path / "nope.pem"
    done = _coordinator("--tls-cert", str(missing), "--tls-key", str(certs.key_file))
    assert done.returncode == 1
    assert f"--tls-cert {missing}" in done.stderr and "No such file" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_key_that_does_not_match_the_certificate_is_a_clear_error(certs, tmp_path):
    other = make_job_certificates(["127.0.0.1"], directory=tmp_path / "other")
    done = _coordinator("--tls-cert", str(certs.cert_file), "--tls-key", str(other.key_file))
    assert done.returncode == 1
    assert "--tls-key" in done.stderr and "Traceback" not in done.stderr


def test_cert_and_key_come_together(certs):
    done = _coordinator("--tls-cert", str(certs.cert_file))
    assert done.returncode == 2
    assert "--tls-cert and --tls-key" in done.stderr
