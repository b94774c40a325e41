"""The dashboard in a real browser, over a real coordinator and a real 3-rank elastic job.

The job (``dashboard_job.py`` under ``horarun --coordinator``) trains on
three loopback hosts; the worker on one of them naps in every step, so it
is the straggler. The tests read the pages as a person would see them, and
compare with what the REST API answers at the same time:

- the jobs list shows the job, live;
- every panel of the job's page shows its data when its REST endpoint has some;
- a worker killed with SIGKILL turns its rank red, the generation goes up
  and the loss, with its cause, is in the event log: within 2 s, without
  a reload. The time from the kill to the red card is printed.

``HORA_UPDATE_SCREENSHOTS=1`` writes the screenshots the README shows to
``docs/``; otherwise they go to a temporary folder.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support.grafana import exported_names, load_dashboard, queried_names

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # the browser fixture skips the browser tests, saying why
    PlaywrightTimeout = TimeoutError  # type: ignore[misc,assignment]

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
VIEWPORT = {"width": 1360, "height": 900}
# The acceptance bound: kill -9 to a red card, a new generation and the loss logged.
LIVE_BOUND_S = 2.0


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield tab
    context.close()
    assert not errors, f"the page logged errors: {errors}"


def _panel_text(page, panel: str) -> str:
    return page.inner_text(f'[data-panel="{panel}"]', timeout=5000)


def _body_text(page, panel: str) -> str:
    """A panel's text below its title."""
    selector = f'[data-panel="{panel}"] .panel-body'
    if panel == "header":
        selector = '[data-panel="header"]'
    return page.inner_text(selector, timeout=5000).strip()


def _points(page, panel: str) -> int:
    """Data points drawn by a panel's charts."""
    return page.evaluate(
        """panel => [...document.querySelectorAll(`[data-panel="${panel}"] svg.chart`)]
             .reduce((n, svg) => n + Number(svg.dataset.points || 0), 0)""", panel)


def _panel_problems(page, job) -> list[str]:
    """What the page fails to show of what REST has now (empty list: all shown)."""
    detail = job.get(f"/api/v1/jobs/{job.job_id}")
    telemetry = job.telemetry()
    events = job.get(f"/api/v1/jobs/{job.job_id}/events")
    problems = []
    text = {panel: _body_text(page, panel) for panel in (
        "header", "ranks", "world", "throughput", "negotiation", "stragglers", "events")}
    empty = {panel: page.locator(f'[data-panel="{panel}"] .empty').count() > 0
             for panel in text}
    # Every panel has REST data in this job; an empty one, or one that shows its
    # "no data" line, fails. Then the figures each must show.
    for panel, shown in text.items():
        if not shown or empty[panel]:
            problems.append(f"panel {panel} is empty: {shown!r}")
    if detail["job_id"] not in text["header"] or \
            page.get_attribute("#job-generation", "data-generation") != str(detail["generation"]):
        problems.append(f"header lacks the job id or generation {detail['generation']}: "
                        f"{text['header']!r}")
    for rank in telemetry["ranks"]:
        card = page.locator(f'.rank-card[data-pid="{rank["pid"]}"][data-host="{rank["host"]}"]'
                            f':not([data-departed])')
        if card.count() != 1 or card.get_attribute("data-state") != rank["state"]:
            problems.append(f"no card for rank {rank['rank']} ({rank['host']}, pid "
                            f"{rank['pid']}, {rank['state']})")
        elif str(rank["pid"]) not in card.inner_text() or rank["host"] not in card.inner_text():
            problems.append(f"rank {rank['rank']}'s card lacks its host or pid")
    if telemetry["series"] and _points(page, "world") == 0:
        problems.append("the world size chart has no points")
    if any(s["steps_per_s"] > 0 for s in telemetry["series"]) and _points(page, "throughput") == 0:
        problems.append("the throughput chart has no points")
    if any(s["samples_per_s"] for s in telemetry["series"]) and \
            "samples per second" not in text["throughput"].lower():
        problems.append("no samples/s chart while the job reports a batch size")
    negotiation = telemetry["negotiation"]
    tile = page.inner_text('[data-stat="negotiated"] .tile-value')
    if tile != str(negotiation["negotiated_tensors"]):
        problems.append(f"tensors negotiated shows {tile!r}, REST {negotiation}")
    if negotiation["cache_hit_ratio"] is not None and \
            page.inner_text('[data-stat="hit-ratio"] .tile-value') == "–":
        problems.append("the cache hit ratio is not shown")
    slowest = telemetry["stragglers"]["slowest_rank"]
    if slowest is not None and f"rank {slowest} " not in text["stragglers"]:
        problems.append(f"the straggler panel does not name rank {slowest}: "
                        f"{text['stragglers']!r}")
    if events and events[-1]["message"] not in text["events"]:
        problems.append(f"the newest event is not in the log: {events[-1]}")
    return problems


def assert_panels_show_rest_data(page, job, timeout: float = 5.0) -> None:
    """Every panel shows what REST has; a few ticks of the live stream are allowed."""
    deadline = time.monotonic() + timeout
    while True:
        problems = _panel_problems(page, job)
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert not problems, "\n".join(problems)


def test_horarun_printed_the_dashboard_url(elastic_job):
    assert f"horarun: dashboard {elastic_job.page_url}" in elastic_job.log(), \
        elastic_job.log()[-3000:]


def test_jobs_list_shows_the_job_live(page, elastic_job, screenshot_dir):
    job = elastic_job
    page.goto(job.coordinator.http_url + "/")
    row = page.locator(f'tr[data-job="{job.job_id}"]')
    row.wait_for(timeout=5000)
    page.wait_for_selector('#live[data-live="live"]', timeout=5000)
    jobs = job.get("/api/v1/jobs")
    assert page.locator("tbody tr").count() == len(jobs)
    (summary,) = [j for j in jobs if j["job_id"] == job.job_id]
    cells = [c.strip() for c in row.locator("td").all_inner_texts()]
    assert cells[0] == job.job_id and cells[1] == "running", cells
    assert cells[2] == "3 / 2 / 3", cells  # world size / min / max
    assert cells[3].startswith(str(summary["generation"])), cells
    assert re.fullmatch(r"\d+(\.\d+)? s|\d+ min \d+ s", cells[4]), cells  # age
    assert float(cells[5]) > 0, cells  # steps/s
    assert summary["last_event"]["kind"] in cells[6], cells
    # Live: the age goes on without a reload.
    page.evaluate("window.__noReload = true")
    page.wait_for_function(
        "before => document.querySelector('tr[data-job] td:nth-child(5)').textContent !== before",
        arg=cells[4], timeout=5000)
    assert page.evaluate("window.__noReload === true")
    page.set_viewport_size({"width": VIEWPORT["width"], "height": 300})
    page.screenshot(path=str(screenshot_dir / "dashboard-jobs.png"), full_page=True)
    row.locator("a").click()
    page.wait_for_url(job.page_url, timeout=5000)
    page.wait_for_selector("#job-id", timeout=5000)
    assert page.inner_text("#job-id") == job.job_id


def test_every_panel_with_data_shows_it(page, elastic_job):
    page.goto(elastic_job.page_url)
    page.wait_for_selector('#live[data-live="live"]', timeout=5000)
    assert_panels_show_rest_data(page, elastic_job)


def test_a_killed_worker_turns_red_and_the_generation_goes_up_without_a_reload(
        page, elastic_job, screenshot_dir):
    job = elastic_job
    page.goto(job.page_url)
    page.wait_for_selector('#live[data-live="live"]', timeout=5000)
    ranks = job.telemetry()["ranks"]
    assert len(ranks) == 3
    # Three active ranks, each with its host and pid.
    for rank in ranks:
        card = page.locator(f'.rank-card[data-rank="{rank["rank"]}"]:not([data-departed])')
        card.wait_for(timeout=5000)
        assert card.get_attribute("data-state") == "active"
        text = card.inner_text()
        assert rank["host"] in text and str(rank["pid"]) in text, text
    assert page.locator('.rank-card[data-state="active"]').count() == 3
    # The straggler panel names the rank that naps.
    slow = next(r for r in ranks if r["host"] == job.slow_host)
    headline = page.locator(f'#slowest[data-slowest-rank="{slow["rank"]}"]')
    headline.wait_for(timeout=5000)
    assert f"rank {slow['rank']} ({job.slow_host}) is a straggler" in headline.inner_text()
    page.wait_for_selector(f'.rank-card[data-rank="{slow["rank"]}"][data-straggler="true"]',
                           timeout=5000)
    page.screenshot(path=str(screenshot_dir / "dashboard-job-straggler.png"), full_page=True)

    victim = next(r for r in ranks if r["rank"] != 0 and r["host"] != job.slow_host)
    generation = int(page.get_attribute("body", "data-generation"))
    page.evaluate("window.__noReload = true")
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    job.killed.append(victim["pid"])
    red = page.locator(f'.rank-card[data-pid="{victim["pid"]}"][data-state="lost"]')
    try:
        red.wait_for(timeout=LIVE_BOUND_S * 1000)
    except PlaywrightTimeout:
        shot = screenshot_dir / "failed-kill.png"
        page.screenshot(path=str(shot), full_page=True)
        raise AssertionError(
            f"rank {victim['rank']} (pid {victim['pid']}) not red within {LIVE_BOUND_S} s of "
            f"its kill; the page ({shot}) shows:\n{page.inner_text('[data-panel=ranks]')}\n"
            f"REST events: {job.get(f'/api/v1/jobs/{job.job_id}/events')[-6:]}") from None
    red_after = time.monotonic() - killed_at
    left = max(0.05, LIVE_BOUND_S - (time.monotonic() - killed_at))
    page.wait_for_function("g => Number(document.body.dataset.generation) > g", arg=generation,
                           timeout=left * 1000)
    loss = page.locator(f'#event-table tr[data-kind="lost"]:has-text("pid {victim["pid"]}")')
    loss.wait_for(timeout=max(0.05, LIVE_BOUND_S - (time.monotonic() - killed_at)) * 1000)
    all_after = time.monotonic() - killed_at
    print(f"\ndashboard: kill -9 of rank {victim['rank']} (pid {victim['pid']}) -> red card "
          f"{red_after:.3f} s, new generation and the loss logged {all_after:.3f} s")
    assert all_after <= LIVE_BOUND_S
    assert page.evaluate("window.__noReload === true"), "the page was reloaded"

    # Red: the card's colour, not only its class.
    colour = red.evaluate("card => getComputedStyle(card).borderLeftColor")
    assert colour == "rgb(200, 30, 30)", colour
    assert victim["host"] in red.inner_text() and f"rank {victim['rank']}" in red.inner_text()
    # The loss and its cause, as the coordinator logged them.
    lost = [e for e in job.get(f"/api/v1/jobs/{job.job_id}/events")
            if e["kind"] == "lost" and e["pid"] == victim["pid"]]
    assert lost and lost[0]["message"], lost
    assert lost[0]["message"] in loss.inner_text()
    assert lost[0]["message"] in red.inner_text()
    assert int(page.get_attribute("body", "data-generation")) == generation + 1
    # The world size chart marks the reset; the header counts it.
    page.wait_for_selector(f'[data-panel="world"] .mark.reset[data-generation="{generation + 1}"]',
                           timeout=5000)
    assert page.inner_text("#job-resets .stat-value") == "1"
    # The event log filters by kind and by text.
    page.select_option("#event-kind", "lost")
    assert set(page.locator("#event-table tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.kind)")) == {"lost"}
    page.select_option("#event-kind", label="all")
    page.fill("#event-text", f"pid {victim['pid']}")
    shown = page.locator("#event-table tbody tr").all_inner_texts()
    assert shown and all(str(victim["pid"]) in row for row in shown), shown
    page.fill("#event-text", "")
    # Newest first.
    times = page.locator("#event-table tbody tr").evaluate_all(
        "rows => rows.map(r => r.querySelector('.time').textContent)")
    assert times == sorted(times, reverse=True), times

    # The survivors go on in the new generation; every panel still shows its data.
    job.wait("2 active ranks stepping in the new generation", lambda t: t["generation"] ==
             generation + 1 and len(t["ranks"]) == 2 and all(
                 r["state"] == "active" and r["reported"] for r in t["ranks"]), 30)
    assert_panels_show_rest_data(page, job)
    page.wait_for_timeout(1500)  # a couple more samples on the charts for the picture
    page.screenshot(path=str(screenshot_dir / "dashboard-job.png"), full_page=True)


def test_grafana_dashboard_plots_only_what_metrics_exports(elastic_job):
    queried = queried_names(load_dashboard())
    assert queried, "the Grafana dashboard has no queries"
    # The job-level telemetry series exist while the job runs with reporting members
    # (not while a round gathers after a loss): scrape then.
    elastic_job.wait("a running generation whose members report", lambda t: t["state"] ==
                     "running" and all(r["reported"] for r in t["ranks"]), 30)
    exported = exported_names(
        httpx.get(elastic_job.coordinator.http_url + "/metrics", timeout=5).text)
    missing = queried - exported
    assert not missing, f"Grafana queries series /metrics does not export: {sorted(missing)}"
    # The per-rank series are there because the job's ranks report.
    for name in ("hora_rank_steps_per_second", "hora_rank_straggler_lag_seconds",
                 "hora_rank_last_arrival_ratio", "hora_job_samples_per_second"):
        assert name in exported, name
