"""The one way hora opens a gRPC channel to the coordinator: TLS when a CA is given.

``HORA_TLS_CA`` (the launcher's ``--tls-ca``) names the CA bundle that
verifies the coordinator's certificate, as a file path or as the PEM text
itself: ``horarun`` hands workers the text, so that workers on other
machines need no copy of the file. Without it the channel is plaintext.
Workers (:mod:`hora._client`) and the launcher (:mod:`hora.runner.events`)
both open their channels here, so they always agree.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import Any

from .settings import SettingsError

__all__ = ["coordinator_channel", "read_ca_bundle"]

_PEM_START = "-----BEGIN"


def read_ca_bundle(value: str) -> bytes:
    """The PEM bytes of a CA bundle given as a file path or as PEM text.

    Raises:
        ValueError: the file cannot be read, or holds no PEM certificate.
    """
    if value.lstrip().startswith(_PEM_START):
        pem, where = value.encode(), "the PEM text given"
    else:
        try:
            with open(value, "rb") as f:
                pem = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read CA bundle {value}: {exc.strerror or exc}") from None
        where = value
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
            cadata=pem.decode("ascii", errors="replace"))
    except (ssl.SSLError, ValueError):
        raise ValueError(f"no PEM certificate in {where}") from None
    return pem


def coordinator_channel(address: str, tls_ca: str,
                        options: Sequence[tuple[str, Any]] = ()) -> Any:
    """A ``grpc.Channel`` to the coordinator at ``address``.

    Args:
        address: ``HOST:PORT``; with TLS the certificate must name ``HOST``.
        tls_ca: CA bundle (path or PEM text) for TLS; empty for plaintext.
        options: gRPC channel options.

    Raises:
        SettingsError: the CA bundle is unusable (the message names HORA_TLS_CA).
    """
    # Here, not at module level: the launcher reads CA bundles without gRPC.
    import grpc

    if not tls_ca:
        return grpc.insecure_channel(address, options=list(options))
    try:
        pem = read_ca_bundle(tls_ca)
    except ValueError as exc:
        raise SettingsError(f"HORA_TLS_CA: {exc}") from None
    credentials = grpc.ssl_channel_credentials(root_certificates=pem)
    return grpc.secure_channel(address, credentials, options=list(options))
