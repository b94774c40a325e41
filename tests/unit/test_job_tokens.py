"""Job tokens, worker secrets and cookie values are derived from the admin token
(issue 25): each opens what it names and nothing else, and none is the admin token."""

from __future__ import annotations

from hora_proto.auth import (
    WEAK_TOKEN_BITS,
    cookie_value,
    job_of_cookie,
    job_of_token,
    job_token,
    token_bits,
    worker_secret,
)

ADMIN = "0123456789abcdef0123456789abcdef"


def test_a_job_token_names_its_job_and_verifies_under_its_admin_token_only():
    for job in ("job-1", "j.with.dots", "ünï/cödé", ""):
        token = job_token(ADMIN, job)
        assert token.startswith("hj1.") and ADMIN not in token
        assert job_of_token(ADMIN, token) == job
        assert job_of_token(ADMIN + "x", token) is None
    token = job_token(ADMIN, "job-1")
    forged = job_token(ADMIN, "job-2").rpartition(".")[0] + "." + token.rpartition(".")[2]
    assert job_of_token(ADMIN, forged) is None  # job-1's MAC does not open job-2
    for garbage in ("hj1.", "hj1.x", "hj1.@@.x", "hj1..", ADMIN, ""):
        assert job_of_token(ADMIN, garbage) is None


def test_worker_secrets_and_cookies_differ_from_every_token():
    secrets = {worker_secret(ADMIN, "j", w) for w in ("w0", "w1")}
    assert len(secrets) == 2 and worker_secret(ADMIN, "j", "w0") == worker_secret(ADMIN, "j", "w0")
    assert worker_secret(ADMIN, "k", "w0") not in secrets
    admin_cookie, job_cookie = cookie_value(ADMIN, None), cookie_value(ADMIN, "j")
    assert ADMIN not in admin_cookie and job_token(ADMIN, "j") not in job_cookie
    assert job_of_cookie(ADMIN, admin_cookie) == (True, None)
    assert job_of_cookie(ADMIN, job_cookie) == (True, "j")
    assert job_of_cookie("other", job_cookie)[0] is False
    assert job_of_cookie(ADMIN, job_token(ADMIN, "j"))[0] is False


def test_token_strength_estimate():
    assert token_bits("abc") < WEAK_TOKEN_BITS
    assert token_bits("0123456789abcdef") < WEAK_TOKEN_BITS  # 16 hex: 64 bits
    assert token_bits("a" * 40) < WEAK_TOKEN_BITS  # long but one character
    assert token_bits(ADMIN) >= WEAK_TOKEN_BITS  # 32 hex: 128 bits
    assert token_bits("Zq3_x9Lm0Pa7Rt2Wy5Bc8N") >= WEAK_TOKEN_BITS  # 22 base64url
