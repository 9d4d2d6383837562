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
from capture.metrics import PHASES, CaptureMetrics
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


def test_no_expression_joins_two_series_with_or() -> None:
    """PromQL's ``a or b`` keeps b's samples only where a has none with the same labels (the metric's name
    left out): two different series there show one. Each series is a target of its own."""
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/headwater.json").read_text())
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    joined = [e for e in exprs if re.search(r"\bor\b", e) and len(set(METRIC.findall(e))) > 1]
    assert not joined, joined


def test_capture_not_streaming_is_not_an_alert_during_a_snapshot() -> None:
    rules = {r["alert"]: r for g in yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"]
             for r in g["rules"]}  # fmt: skip
    found = re.search(
        r'headwater_capture_phase\{phase=~"([^"]+)"\} == 1', rules["HeadwaterCaptureNotStreaming"]["expr"]
    )
    assert found, rules["HeadwaterCaptureNotStreaming"]["expr"]
    phases = re.compile(found[1])
    assert not phases.fullmatch("snapshot") and not phases.fullmatch("streaming")
    assert phases.fullmatch("reconnecting") and phases.fullmatch("starting")
    assert set(PHASES) >= {"snapshot", "streaming", "reconnecting", "starting"}


def test_the_demo_shows_metrics_the_components_expose() -> None:
    from headwater import demo

    assert set(demo.CAPTURE_SHOWN + demo.STREAMS_SHOWN) <= exposed()
