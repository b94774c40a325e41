"""How a caller proves it belongs to a job, and which job.

A coordinator holds one secret, its **admin token**: whoever has it sees and
does everything, as before. Everything else is derived from it, statelessly,
so a restarted coordinator given the same admin token recognises what it
issued before:

- a **job token** (:func:`job_token`), ``hj1.<job id, base64url>.<HMAC>``:
  it names its job, so the coordinator checks it without any lookup and
  without decoding a request, and it opens that job only. ``horarun`` hands
  its workers this token, never the admin one.
- a **worker secret** (:func:`worker_secret`), issued by Join to the worker
  that joined: every later call naming that worker id carries it in
  :data:`WORKER_SECRET_METADATA_KEY`, so one worker of a job cannot speak for
  another.
- the dashboard's **cookie value** (:func:`cookie_value`): a browser keeps a
  value derived from the token it logged in with, never the token.

The HMAC is SHA-256 keyed by the admin token; each use has its own label, so
no derived value can stand in for another.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import string

__all__ = [
    "JOB_TOKEN_PREFIX",
    "TOKEN_METADATA_KEY",
    "WEAK_TOKEN_BITS",
    "WORKER_SECRET_METADATA_KEY",
    "cookie_value",
    "job_of_token",
    "job_token",
    "token_bits",
    "worker_secret",
]

# The gRPC metadata key that carries the admin token or a job token on every call.
TOKEN_METADATA_KEY = "hora-token"
# The gRPC metadata key that carries the worker secret Join issued (calls naming a worker).
WORKER_SECRET_METADATA_KEY = "hora-worker-secret"
#: How a job token starts (it is never an admin token: those are checked first).
JOB_TOKEN_PREFIX = "hj1."
_COOKIE_PREFIX = "hc1."
#: Tokens estimated under this many bits of entropy are weak (:func:`token_bits`).
WEAK_TOKEN_BITS = 128


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None


def _mac(admin: str, label: str, *parts: str) -> str:
    message = "\0".join((label, *parts)).encode("utf-8", "surrogatepass")
    return _b64(hmac.new(admin.encode("utf-8"), message, hashlib.sha256).digest())


def job_token(admin: str, job_id: str) -> str:
    """The token that opens job ``job_id`` only, on a coordinator whose admin token is ``admin``."""
    encoded = _b64(job_id.encode("utf-8", "surrogatepass"))
    return f"{JOB_TOKEN_PREFIX}{encoded}.{_mac(admin, 'hora-job-v1', job_id)}"


def job_of_token(admin: str, token: str) -> str | None:
    """The job ``token`` opens when it is a genuine job token of ``admin``'s, else None.

    Constant time in the MAC; a token that does not parse costs no HMAC.
    """
    if not token.startswith(JOB_TOKEN_PREFIX):
        return None
    encoded, dot, mac = token[len(JOB_TOKEN_PREFIX):].partition(".")
    raw = _unb64(encoded) if dot else None
    if raw is None:
        return None
    try:
        job_id = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    expected = _mac(admin, "hora-job-v1", job_id)
    return job_id if hmac.compare_digest(mac.encode("ascii", "replace"), expected.encode()) else None


def worker_secret(admin: str, job_id: str, worker_id: str) -> str:
    """The secret Join issues to worker ``worker_id`` of job ``job_id``."""
    return _mac(admin, "hora-worker-v1", job_id, worker_id)


def cookie_value(admin: str, job_id: str | None) -> str:
    """What a browser keeps after logging in: with the admin token (``job_id`` None)
    or with the token of ``job_id``. It names the job it opens, like a job token."""
    if job_id is None:
        return f"{_COOKIE_PREFIX}.{_mac(admin, 'hora-cookie-v1')}"
    encoded = _b64(job_id.encode("utf-8", "surrogatepass"))
    return f"{_COOKIE_PREFIX}{encoded}.{_mac(admin, 'hora-cookie-v1', job_id)}"


def job_of_cookie(admin: str, value: str) -> tuple[bool, str | None]:
    """``(valid, job)`` of a cookie value: job None for the admin's cookie."""
    if not value.startswith(_COOKIE_PREFIX):
        return False, None
    encoded, dot, _ = value[len(_COOKIE_PREFIX):].partition(".")
    if not dot:
        return False, None
    job: str | None = None
    if encoded:
        raw = _unb64(encoded)
        try:
            job = raw.decode("utf-8") if raw is not None else None
        except UnicodeDecodeError:
            job = None
        if job is None:
            return False, None
    return hmac.compare_digest(value.encode("utf-8", "replace"),
                               cookie_value(admin, job).encode("utf-8")), job


def token_bits(token: str) -> float:
    """A generous estimate of the entropy of ``token`` in bits, from its length and
    the smallest usual alphabet that spells it (hex, base64url, printable)."""
    if not token:
        return 0.0
    chars = set(token)
    if chars <= set(string.digits):
        alphabet = 10
    elif chars <= set(string.hexdigits):
        alphabet = 16
    elif chars <= set(string.ascii_letters + string.digits + "-_+/="):
        alphabet = 64
    else:
        alphabet = 95
    # A token of one repeated character, or of very few distinct ones, has less.
    alphabet = min(alphabet, max(len(chars), 2) ** 2)
    return len(token) * math.log2(alphabet)
