"""A certificate authority of one job, for ``horarun --tls``.

``horarun --tls`` encrypts a job with no setup: it makes a CA for this job
only, signs a server certificate for its embedded coordinator with it
(naming loopback, this machine's names and the address the coordinator is
advertised on), and hands the workers the CA's certificate. The CA's
private key is never written anywhere: it signs once, in memory, and is
dropped, so nobody can sign another certificate that this job's workers
would trust. The server's key is written, mode 0600, to a private folder
(mode 0700) that the launcher removes when the job ends.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JobCertificates", "make_job_certificates"]

# Longer than any job; the certificates die with the job's folder anyway.
_VALIDITY = datetime.timedelta(days=365)
# Clocks of the machines of a job may disagree a little.
_CLOCK_SKEW = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class JobCertificates:
    """Where one job's certificates are.

    Attributes:
        directory: The private folder (0700) holding the files.
        ca_file: The CA's certificate (PEM): what clients trust.
        cert_file: The coordinator's certificate (PEM), signed by the CA.
        key_file: The coordinator's private key (PEM, mode 0600).
        ca_pem: The contents of ``ca_file``.
    """

    directory: Path
    ca_file: Path
    cert_file: Path
    key_file: Path
    ca_pem: bytes


def _names(addresses: Iterable[str]) -> list[str]:
    wanted = ["127.0.0.1", "::1", "localhost", socket.gethostname(), socket.getfqdn(),
              *addresses]
    return list(dict.fromkeys(name for name in wanted if name))


def _private_directory(directory: Path | None) -> Path:
    if directory is None:
        return Path(tempfile.mkdtemp(prefix="hora-tls-"))  # mode 0700
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    return directory


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)
        f.write(data)


def make_job_certificates(addresses: Iterable[str] = (),
                          directory: Path | None = None) -> JobCertificates:
    """Makes a CA and a coordinator certificate it signs, and writes them.

    Args:
        addresses: Host names or IP addresses clients reach the coordinator
            at, besides 127.0.0.1, ::1, localhost and this machine's names.
        directory: Where to write (made mode 0700); a fresh temporary
            folder when None. The caller removes it.

    Raises:
        OSError: the files cannot be written.
    """
    # Here, not at module level: only --tls needs it.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    job = os.urandom(4).hex()
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"hora job CA {job}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    sans: list[x509.GeneralName] = []
    for name in _names(addresses):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                    f"hora coordinator {job}")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    folder = _private_directory(directory)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    files = JobCertificates(folder, folder / "ca.pem", folder / "server.pem",
                            folder / "server.key", ca_pem)
    _write(files.key_file, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()), 0o600)
    _write(files.cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(files.ca_file, ca_pem, 0o644)
    return files
