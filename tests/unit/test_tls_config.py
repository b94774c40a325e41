"""TLS and token configuration: the per-job CA, the flags, the settings (no servers)."""

from __future__ import annotations

import ipaddress
import socket
import stat
from pathlib import Path

import pytest
from cryptography import x509

from hora._tls import read_ca_bundle
from hora.runner.args import parse_args
from hora.runner.tls import make_job_certificates
from hora.settings import Settings, SettingsError
from hora_coordinator.settings import parse_command_line

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_job_certificates_name_every_address_and_stay_private(tmp_path):
    certs = make_job_certificates(["10.1.2.3", "node7.example"], directory=tmp_path / "tls")
    assert _mode(certs.directory) == 0o700
    assert _mode(certs.key_file) == 0o600
    cert = x509.load_pem_x509_certificate(certs.cert_file.read_bytes())
    ca = x509.load_pem_x509_certificate(certs.ca_file.read_bytes())
    assert certs.ca_pem == certs.ca_file.read_bytes()
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    dns = set(names.get_values_for_type(x509.DNSName))
    assert {"127.0.0.1", "10.1.2.3"} <= ips
    assert {"localhost", "node7.example", socket.gethostname()} <= dns
    assert all(ipaddress.ip_address(ip) for ip in ips)
    ca_constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert ca_constraints.ca and not cert.extensions.get_extension_for_class(
        x509.BasicConstraints).value.ca
    # The CA's own key signed the server certificate and was never written.
    assert sorted(p.name for p in certs.directory.iterdir()) == ["ca.pem", "server.key",
                                                                 "server.pem"]


def test_ca_bundle_is_a_file_or_the_pem_itself(tmp_path):
    certs = make_job_certificates([], directory=tmp_path / "tls")
    assert read_ca_bundle(str(certs.ca_file)) == certs.ca_pem
    assert read_ca_bundle(certs.ca_pem.decode()) == certs.ca_pem
    with pytest.raises(ValueError, match="cannot read"):
        read_ca_bundle(str(tmp_path / "missing.pem"))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="no PEM certificate"):
        read_ca_bundle(str(junk))


def test_workers_read_the_ca_from_hora_tls_ca():
    assert Settings.from_env({}).tls_ca == ""
    assert Settings.from_env({"HORA_TLS_CA": "/etc/ca.pem"}).tls_ca == "/etc/ca.pem"


def test_coordinator_tls_flags(tmp_path, capsys):
    parsed = parse_command_line(["--tls-cert", "c.pem", "--tls-key", "k.pem"], {})
    assert parsed.settings.tls_cert == Path("c.pem") and parsed.settings.tls_key == Path("k.pem")
    assert parse_command_line([], {}).settings.tls_cert is None
    for argv in (["--tls-cert", "c.pem"], ["--tls-key", "k.pem"]):
        with pytest.raises(SystemExit) as exc:
            parse_command_line(argv, {})
        assert exc.value.code == 2
        assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    token_file = parse_command_line(["--token-file", str(tmp_path / "t")], {}).token_file
    assert token_file == tmp_path / "t"


def test_horarun_tls_flags(tmp_path, capsys):
    certs = make_job_certificates([], directory=tmp_path / "tls")
    assert parse_args(["--tls", "-np", "2", "true"], {}).tls
    config = parse_args(["--coordinator", "h:1", "--tls-ca", str(certs.ca_file), "-np", "1",
                         "true"], {})
    assert config.tls_ca == certs.ca_pem.decode() and not config.tls
    from_env = parse_args(["--coordinator", "h:1", "-np", "1", "true"],
                          {"HORA_TLS_CA": str(certs.ca_file)})
    assert from_env.tls_ca == certs.ca_pem.decode()
    # The environment's CA is for a running coordinator; an embedded one ignores it.
    assert parse_args(["-np", "1", "true"], {"HORA_TLS_CA": str(certs.ca_file)}).tls_ca == ""
    bad = {
        ("--tls", "--coordinator", "h:1"): "--tls-ca",
        ("--tls-ca", str(certs.ca_file)): "--coordinator",
        ("--coordinator", "h:1", "--tls-ca", str(tmp_path / "nope.pem")): "cannot read",
        ("--coordinator", "h:1", "--tls-ca", str(certs.key_file)): "no PEM certificate",
    }
    for argv, message in bad.items():
        with pytest.raises(SystemExit) as exc:
            parse_args([*argv, "-np", "1", "true"], {})
        assert exc.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_settings_error_names_the_variable(tmp_path):
    from hora._tls import coordinator_channel

    with pytest.raises(SettingsError, match="HORA_TLS_CA"):
        coordinator_channel("127.0.0.1:1", str(tmp_path / "missing.pem"))
