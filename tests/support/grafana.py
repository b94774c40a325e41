"""The Grafana dashboard under ``deploy/grafana/`` and the metric names its queries use."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["DASHBOARD", "exported_names", "load_dashboard", "queries", "queried_names"]

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "hora-dashboard.json"
_NAME = re.compile(r"\bhora_[a-z0-9_]+")
# Keys whose string values are PromQL: panel targets, variables, annotations.
_QUERY_KEYS = frozenset({"expr", "definition", "query"})


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def queries(node: Any) -> Iterator[str]:
    """Every PromQL string in the dashboard."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _QUERY_KEYS and isinstance(value, str):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def queried_names(dashboard: dict[str, Any]) -> set[str]:
    """The metric names the dashboard's queries use."""
    return {name for text in queries(dashboard) for name in _NAME.findall(text)}


def exported_names(metrics_text: str) -> set[str]:
    """The sample names in a Prometheus text exposition (``/metrics``)."""
    names = set()
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
