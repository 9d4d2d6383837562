"""deploy/: the alerting rules and the Grafana dashboard name only metrics capture and the workers expose."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from capture.config import CaptureConfig
from capture.metrics import CaptureMetrics
from streams.metrics import StreamsMetrics

ROOT = Path(__file__).resolve().parent.parent
METRIC = re.compile(r"\b(headwater_[a-z_]+|process_[a-z_]+)\b")
pytestmark = pytest.mark.unit


def exposed() -> set[str]:
    """Every series name the two components expose (counters with their ``_total``)."""
    names: set[str] = set()
    for registry in (CaptureMetrics(CaptureConfig()).registry, StreamsMetrics().registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names.add(family.name)
            names.update(s.name for s in family.samples)
            if family.type == "counter":
                names.add(family.name + "_total")
    return names


def test_alert_rules_use_exposed_metrics() -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert len(exprs) >= 8 and all("alert" in r for g in rules["groups"] for r in g["rules"])
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used and not used - exposed(), sorted(used - exposed())
    jobs = {c["job_name"] for c in yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
            ["scrape_configs"]}  # fmt: skip
    assert jobs == {"headwater-capture", "headwater-streams"}
    assert all(job in " ".join(exprs) for job in jobs), "an 'up' rule per job"


def test_dashboard_panels_use_exposed_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/headwater.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert len(used) > 15 and not used - exposed(), sorted(used - exposed())


def test_names_follow_prometheus_conventions() -> None:
    for name in exposed():
        if name.startswith("headwater_"):
            assert re.fullmatch(r"headwater_(capture|streams)_[a-z0-9_]+", name), name
            assert not name.endswith(("_ms", "_milliseconds", "_kb", "_mb")), f"{name}: seconds and bytes only"
