"""Where the job token comes from, where it is kept, and how to tell people about it.

The token is, in order: ``--token``, ``$HORA_TOKEN``, the contents of
``--token-file`` when that file exists, else a random one made up at start.
With ``--token-file`` the file always ends up holding the token in use
(written mode 0600 through a temporary file and a rename), so a coordinator
restarted with the same flags keeps its token and its workers' trust. A
token file that others may read is refused, as ssh refuses such a key.

A made-up token is printed once, with how to connect (:func:`connect_help`),
as Jupyter prints its URL: nobody else could know it.
"""

from __future__ import annotations

import enum
import os
import socket
import stat
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from hora_proto.auth import WEAK_TOKEN_BITS, token_bits

from .rest_auth import is_loopback
from .settings import CoordinatorSettings

__all__ = [
    "WEAK_TOKEN_BITS",
    "TokenFileError",
    "TokenSource",
    "WeakTokenError",
    "check_strength",
    "connect_help",
    "resolve_token",
]


class TokenFileError(RuntimeError):
    """The token file cannot be read or written, is empty, or others may read it."""


class WeakTokenError(RuntimeError):
    """A weak token on an address other machines reach, without ``--allow-weak-token``."""


def check_strength(settings: CoordinatorSettings) -> str | None:
    """A warning when the admin token is weak (under :data:`WEAK_TOKEN_BITS` bits, e.g.
    fewer than 32 hex or 22 base64 characters), else None.

    Raises:
        WeakTokenError: it is weak and the servers bind an address off loopback,
            unless ``settings.allow_weak_token``.
    """
    bits = token_bits(settings.token)
    if bits >= WEAK_TOKEN_BITS:
        return None
    problem = (f"the token has about {bits:.0f} bits of entropy, under {WEAK_TOKEN_BITS}: "
               f"it can be guessed. Use a random one (e.g. `openssl rand -hex 16`), or leave "
               f"--token and $HORA_TOKEN unset and one is made up")
    if not is_loopback(settings.host) and not settings.allow_weak_token:
        raise WeakTokenError(f"{problem}; refusing to serve it on {settings.host} "
                             f"(--allow-weak-token serves it anyway)")
    return problem


class TokenSource(enum.Enum):
    """Where the token in use came from."""

    GIVEN = "given"  # --token or $HORA_TOKEN
    FILE = "file"  # read from --token-file
    MADE_UP = "made up"  # random, made at start


@dataclass(frozen=True)
class ResolvedToken:
    """Settings with their token, and where it came from."""

    settings: CoordinatorSettings
    source: TokenSource


def _read(path: Path) -> str:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise TokenFileError(
                f"--token-file {path} may be read by others (mode {mode:04o}); the token "
                f"would not be secret: chmod 600 {path}"
            )
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise TokenFileError(f"cannot read --token-file {path}: {exc.strerror or exc}") from None
    if not token:
        raise TokenFileError(f"--token-file {path} is empty; delete it to make a new token")
    return token


def _write(path: Path, token: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    except OSError as exc:
        raise TokenFileError(f"cannot write --token-file {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise TokenFileError(f"cannot write --token-file {path}: {exc.strerror or exc}") from None


def resolve_token(settings: CoordinatorSettings, token_file: Path | None) -> ResolvedToken:
    """The settings with their token settled, reading or writing ``token_file``.

    Raises:
        TokenFileError: the file is unusable (see the module docstring).
    """
    if settings.token:
        source = TokenSource.GIVEN
    elif token_file is not None and token_file.exists():
        settings = replace(settings, token=_read(token_file))
        return ResolvedToken(settings, TokenSource.FILE)
    else:
        settings, source = settings.with_token(), TokenSource.MADE_UP
    if token_file is not None:
        _write(token_file, settings.token)
    return ResolvedToken(settings, source)


def _public_host(host: str) -> str:
    """The host to tell clients: this machine's name for a wildcard address."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def connect_help(
    host: str, grpc_port: int, http_port: int, token: str, tls: bool, token_file: Path | None
) -> str:
    """The block a coordinator prints when it made its token up: how to connect."""
    name = _public_host(host)
    grpc_address = f"[{name}]:{grpc_port}" if ":" in name else f"{name}:{grpc_port}"
    http_host = f"[{name}]:{http_port}" if ":" in name else f"{name}:{http_port}"
    url = f"{'https' if tls else 'http'}://{http_host}"
    ca = " --tls-ca CA.pem" if tls else ""
    lines = [
        "hora-coordinator made up a job token (no --token or $HORA_TOKEN given"
        + (", and no --token-file yet)." if token_file is not None else ")."),
        "Keep it secret; whoever has it can join jobs and read their state. To connect:",
        f"    gRPC:      {grpc_address}",
        f"    HTTP API:  {url}/api/v1/jobs?token={token}",
        f"               (or header 'Authorization: Bearer {token}', or cookie hora_token)",
        f"    dashboard: {url}/?token={token}",
        f"    a job:     HORA_TOKEN={token} horarun --coordinator {grpc_address}{ca} "
        f"-np 2 python train.py",
        f"    workers:   HORA_COORDINATOR={grpc_address} HORA_TOKEN={token}"
        + (" HORA_TLS_CA=CA.pem" if tls else ""),
    ]
    if tls:
        lines.append("    (CA.pem: the CA bundle that signed --tls-cert)")
    if token_file is not None:
        lines.append(f"    The token is kept in {token_file} (mode 0600).")
    return "\n".join(lines)
