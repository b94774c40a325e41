"""TLS for both servers: the certificate and key files, read and checked once at start.

gRPC takes the PEM bytes (:meth:`ServerTLS.grpc_credentials`); uvicorn takes
the file paths. Both are checked here first, so that a missing file or a key
that does not match the certificate ends the start with one clear line
instead of a traceback from deep inside either server.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from .settings import CoordinatorSettings

__all__ = ["ServerTLS", "TLSConfigError", "load_server_tls"]


class TLSConfigError(RuntimeError):
    """The certificate or key cannot be read, or they do not belong together."""


@dataclass(frozen=True)
class ServerTLS:
    """A certificate and its key, as both servers use them.

    Attributes:
        cert_file: The PEM certificate (chain).
        key_file: The PEM private key.
        cert_pem: The contents of ``cert_file``.
        key_pem: The contents of ``key_file``.
    """

    cert_file: Path
    key_file: Path
    cert_pem: bytes
    key_pem: bytes

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials for ``add_secure_port`` (no client certificates asked)."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def _read(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None


def load_server_tls(settings: CoordinatorSettings) -> ServerTLS | None:
    """The TLS files of ``settings``, read and checked; None when it serves plaintext.

    Raises:
        TLSConfigError: a file cannot be read, is not PEM, or the key is not the
            certificate's.
    """
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    cert_pem = _read("--tls-cert", settings.tls_cert)
    key_pem = _read("--tls-key", settings.tls_key)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(settings.tls_cert, settings.tls_key)
    except ssl.SSLError as exc:
        raise TLSConfigError(
            f"--tls-cert {settings.tls_cert} and --tls-key {settings.tls_key} are not a PEM "
            f"certificate and its private key ({exc.reason or exc})"
        ) from None
    return ServerTLS(settings.tls_cert, settings.tls_key, cert_pem, key_pem)
