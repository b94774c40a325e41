"""The login form in a real browser, off loopback.

The coordinator binds an address of a network namespace the test makes, and
chromium runs inside that namespace too (a Playwright script started with
``ip netns exec``), so the page is served from a non-loopback address for
real: the browser gets the form, a wrong token is refused, the right one is
taken once and kept in an HttpOnly cookie, and the job's page then loads its
data and live stream with that cookie alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hora_proto.auth import cookie_value

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(90)]

CLIENTS = Path(__file__).resolve().parents[1] / "coordinator"

JOIN = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from coordinator_clients import Client
    client = Client(sys.argv[1], sys.argv[2])
    client.join_all(sys.argv[4], 1, hosts=["login-host"])
    client.close()
""")

# Runs inside the namespace: drives chromium through the login, prints what it saw.
BROWSE = textwrap.dedent("""
    import json, sys
    from playwright.sync_api import sync_playwright
    chromium, url, token, job = sys.argv[1:5]
    seen = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox"], timeout=30000)
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(10000)
        first = page.goto(f"{url}/jobs/{job}")
        seen["first_status"] = first.status
        seen["first_text"] = page.inner_text("body")
        page.fill("#token", "not-the-token")
        with page.expect_navigation():
            page.click("button[type=submit]")
        seen["wrong_text"] = page.inner_text("body")
        seen["cookies_after_wrong"] = [c["name"] for c in context.cookies()]
        page.fill("#token", token)
        with page.expect_navigation():
            page.click("button[type=submit]")
        seen["url_after_login"] = page.url
        page.wait_for_selector("#job-id")
        seen["job_id_shown"] = page.inner_text("#job-id")
        page.wait_for_selector(".rank-card")
        seen["rank_text"] = page.inner_text('[data-panel="ranks"]')
        page.wait_for_selector('#live[data-live="live"]')
        seen["live"] = True
        seen["cookies"] = context.cookies()
        page.goto(f"{url}/")
        page.wait_for_selector(f'tr[data-job="{job}"]')
        seen["jobs_row"] = page.inner_text(f'tr[data-job="{job}"]')
        browser.close()
    print(json.dumps(seen))
""")


def _inside(netns, *argv: str, timeout: float = 60) -> str:
    done = subprocess.run([*netns.prefix, sys.executable, *argv], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_token_is_asked_once_and_kept_in_a_cookie(chromium_executable, coordinator_factory,
                                                       netns):
    coordinator = coordinator_factory(host=netns.address, command_prefix=netns.prefix)
    token, job = coordinator.token, "login-job"
    _inside(netns, "-c", JOIN, coordinator.grpc_address, token, str(CLIENTS), job)
    seen = json.loads(_inside(netns, "-c", BROWSE, chromium_executable, coordinator.http_url,
                              token, job).splitlines()[-1])

    assert seen["first_status"] == 401
    assert "Job token" in seen["first_text"] and "login-host" not in seen["first_text"]
    assert "Wrong token" in seen["wrong_text"]
    assert seen["cookies_after_wrong"] == []
    assert seen["url_after_login"] == f"{coordinator.http_url}/jobs/{job}"
    assert seen["job_id_shown"] == job
    assert "login-host" in seen["rank_text"]
    assert seen["live"]
    (cookie,) = seen["cookies"]
    # A value derived from the token (issue 25), never the token itself.
    assert (cookie["name"], cookie["value"]) == ("hora_token", cookie_value(token, None))
    assert token not in cookie["value"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and not cookie["secure"]
    assert job in seen["jobs_row"]
