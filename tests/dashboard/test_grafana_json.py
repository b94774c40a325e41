"""The Grafana dashboard (``deploy/grafana/hora-dashboard.json``) is well formed and only
queries series the coordinator documents; ``test_dashboard.py`` checks them against a
real ``/metrics`` of a running job."""

from __future__ import annotations

import re

import pytest

from hora_coordinator import metrics
from tests.support.grafana import load_dashboard, queried_names, queries

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _documented() -> set[str]:
    """The series listed in hora_coordinator.metrics' docstring."""
    listed = set(re.findall(r"^\s{4}(hora_[a-z0-9_]+)", metrics.__doc__ or "", re.M))
    assert len(listed) > 20, "the metrics module's docstring no longer lists its series"
    return listed


def test_every_query_names_a_documented_series():
    dashboard = load_dashboard()
    missing = queried_names(dashboard) - _documented()
    assert not missing, f"the dashboard queries series the coordinator does not export: {missing}"


def test_it_plots_the_per_rank_and_job_telemetry():
    names = queried_names(load_dashboard())
    for wanted in ("hora_rank_steps_per_second", "hora_rank_steps_total",
                   "hora_rank_straggler_lag_seconds", "hora_rank_last_arrival_ratio",
                   "hora_job_steps_per_second", "hora_job_samples_per_second",
                   "hora_job_messages_per_step", "hora_job_cache_hit_ratio",
                   "hora_job_generation", "hora_job_members", "hora_job_resets_total"):
        assert wanted in names, wanted
    both = " ".join(queries(load_dashboard()))
    assert 'quantile="0.5"' in both and 'quantile="0.95"' in both


def test_panels_are_well_formed():
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"DS_PROMETHEUS", "job"} <= variables
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            # Every query is narrowed to the chosen jobs (but the per-state job count).
            assert 'job_id=~"$job"' in target["expr"] or target["expr"] == "hora_jobs", \
                target["expr"]
