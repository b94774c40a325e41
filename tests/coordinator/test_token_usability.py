"""Finding the job token: printed when made up, kept in --token-file, named in refusals."""

from __future__ import annotations

import stat
import textwrap
from pathlib import Path

import httpx
import pytest
from workers import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_made_up_token_is_printed_with_how_to_connect(coordinator_factory):
    coordinator = coordinator_factory(token="")
    token, log = coordinator.token, coordinator.log()
    assert len(token) >= 32
    address = coordinator.grpc_address
    assert f"HORA_TOKEN={token} horarun --coordinator {address} " in log, log
    assert f"{coordinator.http_url}/api/v1/jobs?token={token}" in log, log
    assert f"Authorization: Bearer {token}" in log, log
    # What it prints works: the URL with ?token= answers.
    answer = httpx.get(f"{coordinator.http_url}/api/v1/jobs?token={token}", timeout=5)
    assert answer.status_code == 200


def test_a_given_token_is_never_printed(coordinator):
    assert coordinator.token not in coordinator.log()


def test_token_file_is_private_and_keeps_the_token_across_restarts(coordinator_factory,
                                                                   tmp_path):
    path = tmp_path / "secrets" / "token"
    first = coordinator_factory("--token-file", str(path), token="")
    assert path.read_text().strip() == first.token
    assert _mode(path) == 0o600
    assert str(path) in first.log()
    first.stop()
    # A restart with the same file (and no --token) serves the same token, quietly.
    second = coordinator_factory("--token-file", str(path), token="")
    assert second.token == first.token
    assert first.token not in second.log()
    second.stop()
    # An explicit token wins and is written over the file.
    third = coordinator_factory("--token-file", str(path), token="given-token")
    assert third.token == "given-token"
    assert path.read_text().strip() == "given-token" and _mode(path) == 0o600


def test_a_token_file_others_can_read_is_refused(coordinator_factory, tmp_path):
    path = tmp_path / "token"
    path.write_text("leaked\n")
    path.chmod(0o644)
    with pytest.raises(RuntimeError, match=r"chmod 600"):
        coordinator_factory("--token-file", str(path), token="")


SCENARIO = textwrap.dedent("""
    def nothing():
        return None
""")


@pytest.mark.parametrize("sent", ["wrong-token", ""])
def test_a_refused_worker_is_told_where_the_token_comes_from(coordinator, tmp_path, sent):
    scenario = tmp_path / "scenario.py"
    scenario.write_text(SCENARIO)
    (result,) = run_workers(coordinator, 1, scenario, "nothing", expect_ok=False,
                            env={"HORA_TOKEN": sent}, timeout=60)
    assert result.error_type == "AuthenticationError", result.traceback
    message = result.error
    assert coordinator.grpc_address in message
    for source in ("HORA_TOKEN", "--token", "--token-file", "printed"):
        assert source in message, message
    if not sent:
        assert "no token" in message, message
