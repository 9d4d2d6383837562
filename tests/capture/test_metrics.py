"""Capture's metrics port (/metrics, /health, /ready) and its log lines, on the real stack under the shop's load."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from headwater import shop
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.stack import ProxiedBroker

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample of ``url``/metrics: (name, sorted labels) -> value."""
    answer = httpx.get(url + "/metrics", timeout=10)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(answer.text) for s in family.samples}  # fmt: skip


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_ready(capture: Capture, timeout: float = 60) -> list[int]:
    """Poll /ready until 200; the statuses seen on the way."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        capture.raise_error()
        try:
            seen.append(httpx.get(capture.metrics_url + "/ready", timeout=5).status_code)
        except httpx.HTTPError:
            seen.append(0)  # not listening yet
        if seen[-1] == 200:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"capture not ready within {timeout} s: {seen[-5:]}")


def test_metrics_move_while_the_shop_workload_runs(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture]
) -> None:
    capture = capture_factory(pg_database, heartbeat_interval=0.5).start()
    wait_ready(capture)
    url = capture.metrics_url
    assert httpx.get(url + "/health", timeout=5).json()["status"] == "alive"
    assert httpx.get(url + "/nope", timeout=5).status_code == 404
    capture.wait_caught_up(pg_database)
    time.sleep(1.5)  # idle: heartbeats; a few status intervals report
    before = scrape(url)
    counts = shop.counts(shop_db)
    for table in ("customers", "orders", "order_items"):
        labels = {"kind": "snapshot", "table": f"public.{table}"}
        assert value(before, "headwater_capture_snapshot_rows_read", **labels) == counts[table]
        assert value(before, "headwater_capture_snapshot_rows_expected", **labels) >= counts[table]
        assert value(before, "headwater_capture_events_total", table=f"public.{table}", op="READ") == counts[table]
    assert value(before, "headwater_capture_heartbeats_total") > 0
    assert value(before, "headwater_capture_streaming") == 1
    assert value(before, "headwater_capture_broker_reachable") == 1

    writer = ShopWriter(pg_database, rate=100).start()
    time.sleep(3)
    committed = writer.stop()
    capture.wait_caught_up(pg_database)
    time.sleep(1.5)
    after = scrape(url)
    moved = {op: value(after, "headwater_capture_events_total", table="public.orders", op=op)
             - value(before, "headwater_capture_events_total", table="public.orders", op=op)
             for op in ("INSERT", "UPDATE", "DELETE")}  # fmt: skip
    assert all(n > 0 for n in moved.values()), moved
    name = "headwater_capture_transactions_total"
    transactions = value(after, name) - value(before, name)
    assert transactions >= committed > 100, (transactions, committed)  # heartbeats are empty transactions: not counted
    confirmed = value(after, "headwater_capture_confirmed_lsn")
    assert confirmed > value(before, "headwater_capture_confirmed_lsn")
    assert value(after, "headwater_capture_server_lsn") >= confirmed
    assert 0 < value(after, "headwater_capture_slot_retained_bytes") < 1024**3
    assert 0 <= value(after, "headwater_capture_behind_source_seconds") < 30
    assert abs(time.time() - value(after, "headwater_capture_last_commit_timestamp_seconds")) < 60
    assert value(after, "headwater_capture_producer_queue_max_messages") > 0
    assert value(after, "headwater_capture_delivery_errors_total") == 0
    assert value(after, "process_resident_memory_bytes") > 0
    assert value(after, "headwater_capture_info", slot=capture.cfg.slot, publication=capture.cfg.publication,
                 topic=capture.cfg.changes_topic, version="") == 1  # fmt: skip


def test_slot_above_its_warning_size_is_said_once(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], caplog: pytest.LogCaptureFixture
) -> None:
    capture = capture_factory(pg_database, slot_warn_bytes=1)
    with caplog.at_level(logging.WARNING, logger="headwater.capture"):
        capture.start()
        capture.wait_caught_up(pg_database)
        writer = ShopWriter(pg_database, rate=50).start()
        time.sleep(3)  # the slot is looked at every 5 status intervals (1 s here)
        writer.stop()
        capture.stop()
    said = [r for r in caplog.records if "above slot_warn_bytes" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert getattr(said[0], "slot", None) == capture.cfg.slot and getattr(said[0], "lsn", "").count("/") == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("capture starting") for m in messages) and any("capture stopped" in m for m in messages)


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of a log written with --log-format json (each must be one JSON object)."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.slow
def test_json_log_lines_and_log_levels(pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture]) -> None:
    capture = capture_factory(pg_database)
    process = capture.spawn("--log-format", "json", "--log-level", "warning")
    wait_ready(capture)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert capture.log is not None
    lines = json_lines(capture.log.read_text())
    assert {line["level"] for line in lines} <= {"WARNING", "ERROR", "CRITICAL"}, "INFO lines at --log-level warning"
    assert all({"time", "level", "component", "logger", "message"} <= set(line) for line in lines)
    start = next(line for line in lines if line["message"].startswith("capture starting"))
    assert start["component"] == "capture" and start["slot"] == capture.cfg.slot
    assert start["topic"] == capture.cfg.changes_topic
    assert lines[-1]["message"].startswith("capture stopped"), lines[-1]

    capture.log.write_text("")
    env = {"HEADWATER_LOG_LEVEL": "info", "HEADWATER_LOG_FORMAT": "json"}
    os.environ.update(env)  # the environment's settings, no flags (spawn passes os.environ on)
    try:
        process = capture.spawn()
        wait_ready(capture)
    finally:
        for key in env:
            os.environ.pop(key)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    lines = json_lines(capture.log.read_text())
    streaming = next(line for line in lines if line["message"].startswith("streaming from slot"))
    assert streaming["level"] == "INFO" and streaming["slot"] == capture.cfg.slot and "/" in streaming["lsn"]


def episodes(log: str) -> tuple[list[str], list[str], list[str]]:
    """(Kafka unreachable lines, Kafka back lines, librdkafka's own lines and error callbacks)."""
    lines = log.splitlines()
    began = [line for line in lines if "does not answer (" in line]
    ended = [line for line in lines if "answers again" in line]
    noise = [line for line in lines if " headwater.kafka: " in line or "headwater.capture: kafka: " in line]
    return began, ended, noise


@pytest.mark.slow
def test_a_broker_away_is_logged_once_when_it_begins_and_once_when_it_ends(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], proxied_broker: ProxiedBroker
) -> None:
    """Connections dropped and refused for 12 s, then the broker paused (SIGSTOP) for 12 s, under load: two
    episodes, each one WARNING when it begins and one when it ends — not librdkafka's line every second."""
    capture = capture_factory(pg_database, bootstrap=proxied_broker.bootstrap, on_error="log")
    process = capture.spawn()
    wait_ready(capture)
    writer = ShopWriter(pg_database, rate=50).start()
    time.sleep(2)
    outage = threading.Thread(target=proxied_broker.proxy.outage, args=(12,))
    outage.start()
    time.sleep(9)
    during = httpx.get(capture.metrics_url + "/ready", timeout=5)
    outage.join()
    wait_ready(capture, timeout=60)
    pid = proxied_broker.service.pid()
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(12)
        paused = httpx.get(capture.metrics_url + "/ready", timeout=5)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_ready(capture, timeout=60)
    committed = writer.stop()
    capture.wait_caught_up(pg_database, timeout=120)
    assert process.poll() is None, "capture died"
    capture.stop()
    assert capture.log is not None
    began, ended, noise = episodes(capture.log.read_text())
    assert len(began) == 2 and len(ended) == 2, "\n".join(began + ended)
    assert noise == [], "librdkafka's connection lines:\n" + "\n".join(noise[:5])
    for answer in (during, paused):
        assert answer.status_code == 503 and "Kafka" in answer.json()["reason"], answer.text
    assert committed > 500
