"""Capture's metrics port (/metrics, /health, /ready) and its log lines, on the real stack under the shop's load."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from capture.changes import ChangeSink, RowChange, TxBuffer
from capture.config import CaptureConfig
from capture.encoder import change_writer
from capture.metrics import CaptureMetrics, Probe
from capture.producer import ChangeProducer, ensure_changes_topic
from capture.slotwatch import SlotWatch
from headwater import shop
from tables.config import Secret, Settings
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
    """The sample's value; a sample that is not there fails the test (it is not 0)."""
    found = maybe(samples, name, **labels)
    assert found is not None, f"no sample {name}{labels or ''}: {sorted(n for n, _ in samples if 'headwater' in n)}"
    return found


def maybe(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


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
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], shop_writer: Callable[..., ShopWriter]
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
    assert value(before, "headwater_capture_phase", phase="streaming") == 1
    assert value(before, "headwater_capture_phase", phase="snapshot") == 0
    assert value(before, "headwater_capture_broker_reachable") == 1
    assert abs(time.time() - value(before, "headwater_capture_last_report_timestamp_seconds")) < 10

    writer = shop_writer(rate=100)
    time.sleep(3)
    committed = writer.stop()
    capture.wait_caught_up(pg_database)
    time.sleep(1.5)
    after = scrape(url)
    moved = {op: value(after, "headwater_capture_events_total", table="public.orders", op=op)
             - (maybe(before, "headwater_capture_events_total", table="public.orders", op=op) or 0)
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
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], caplog: pytest.LogCaptureFixture,
    shop_writer: Callable[..., ShopWriter]
) -> None:
    capture = capture_factory(pg_database, slot_warn_bytes=1)
    with caplog.at_level(logging.WARNING, logger="headwater.capture"):
        capture.start()
        capture.wait_caught_up(pg_database)
        writer = shop_writer(rate=50)
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
    """A consumer's setting among the producer's (as a shared [pipeline] kafka has) makes librdkafka warn, in
    capture's producer and in the snapshot's sender (C); a producer's makes capture's raw topic readers (the
    snapshot's retraction reads the raw topic's keys) warn at DEBUG only (the settings are shared on purpose):
    every line is JSON all the same."""
    capture = capture_factory(pg_database, producer={"fetch.wait.max.ms": "100", "linger.ms": "5"})
    process = capture.spawn("--log-format", "json", "--log-level", "warning")
    wait_ready(capture)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert capture.log is not None
    lines = json_lines(capture.log.read_text())
    warned = [line for line in lines if line["logger"] == "headwater.kafka" and "fetch.wait.max.ms" in line["message"]]
    assert len(warned) >= 2, "capture's producer and the snapshot's sender each warn"
    assert not any("queue.buffering.max.ms" in line["message"] for line in lines), "a reader's warning of linger.ms"
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
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], proxied_broker: ProxiedBroker,
    shop_writer: Callable[..., ShopWriter]
) -> None:
    """Connections dropped and refused for 12 s, then the broker paused (SIGSTOP) for 12 s, under load with a
    producer queue that fills within a second or two (capture then waits in the send): two episodes, each one
    WARNING when it begins (5 s after Kafka stopped answering) and one when it ends — not librdkafka's line
    every second; meanwhile /ready says why, the slot is still looked at and nothing unacknowledged is counted."""
    capture = capture_factory(pg_database, bootstrap=proxied_broker.bootstrap, on_error="log",
                              producer={"queue.buffering.max.messages": "500"})  # fmt: skip
    process = capture.spawn()
    wait_ready(capture)
    writer = shop_writer(rate=50)
    time.sleep(2)

    def look(_: str) -> tuple[Samples, httpx.Response, Samples]:
        early = scrape(capture.metrics_url)
        time.sleep(2)
        return early, httpx.get(capture.metrics_url + "/ready", timeout=5), scrape(capture.metrics_url)

    seen = proxied_broker.outages(look, between=lambda: wait_ready(capture, timeout=60))
    (early, during, late), paused = seen["cut"], seen["paused"][1]
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
    assert all(5 <= float(re.search(r"seconds=([\d.]+)", line)[1]) < 8 for line in began), began  # type: ignore[index]
    assert value(late, "headwater_capture_producer_queue_messages") >= 500 - 10, "the queue did not fill"
    assert value(late, "headwater_capture_broker_reachable") == 0
    assert value(late, "headwater_capture_slot_lag_bytes") > value(early, "headwater_capture_slot_lag_bytes")
    name = "headwater_capture_events_total"
    assert value(late, name, table="public.orders", op="INSERT") == value(early, name, table="public.orders",
                                                                          op="INSERT")  # fmt: skip
    assert committed > 500


def wait_phase(capture: Capture, phase: str, timeout: float = 60) -> None:
    """Poll /metrics until capture's phase is ``phase``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        capture.raise_error()
        try:
            if maybe(scrape(capture.metrics_url), "headwater_capture_phase", phase=phase) == 1:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.05)
    raise AssertionError(f"capture not in phase {phase} within {timeout} s")


@pytest.mark.slow
def test_a_broker_paused_during_the_snapshot_is_logged_once_when_it_begins_and_once_when_it_ends(
    pg_database: str, capture_factory: Callable[..., Capture], proxied_broker: ProxiedBroker
) -> None:
    """The snapshot's rows go out from C senders in worker processes: the broker paused (SIGSTOP) for 12 s
    while they copy is still one WARNING 5 s in and one when it answers again, the reachability gauge at 0
    meanwhile; the snapshot then completes, every row on the raw topic."""
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE bulk (id int PRIMARY KEY, v text)")
        cur.execute("INSERT INTO bulk SELECT i, repeat('x', 20) FROM generate_series(1, 1000000) i")
    conn.close()
    capture = capture_factory(pg_database, bootstrap=proxied_broker.bootstrap, include="public.bulk",
                              producer={"queue.buffering.max.messages": "2000"})  # fmt: skip
    process = capture.spawn()
    wait_phase(capture, "snapshot")
    with proxied_broker.paused():
        time.sleep(8)
        during = scrape(capture.metrics_url)
        time.sleep(4)
    wait_ready(capture, timeout=120)
    assert process.poll() is None, "capture died"
    capture.stop()
    assert capture.log is not None
    log = capture.log.read_text()
    began, ended, noise = episodes(log)
    assert len(began) == 1 and len(ended) == 1, "\n".join(began + ended)
    assert "snapshot's rows wait" in began[0] and noise == [], began + noise[:5]
    assert 5 <= float(re.search(r"seconds=([\d.]+)", began[0])[1]) < 9, began  # type: ignore[index]
    assert value(during, "headwater_capture_broker_reachable") == 0
    assert value(during, "headwater_capture_phase", phase="snapshot") == 1
    done = re.search(r"snapshot done: (\d+) rows", log)
    assert done is not None and int(done[1]) == 1_000_000, log[-2000:]


def test_the_slot_is_looked_at_before_capture_streams(pg_database: str, unique_name: str) -> None:
    """Whatever capture's own thread does (here: nothing yet, phase "starting"), the slot watch shows the slot;
    nothing is shown before it has looked: an unknown value is no sample, not 0."""
    cfg = CaptureConfig(dsn=Secret(pg_database), slot=unique_name, status_interval=0.2, metrics_port=0)
    metrics = CaptureMetrics(cfg)
    first = exposition(metrics)
    for name in ("headwater_capture_slot_retained_bytes", "headwater_capture_confirmed_lsn",
                 "headwater_capture_broker_reachable", "headwater_capture_behind_source_seconds"):  # fmt: skip
        assert maybe(first, name) is None, name
    assert value(first, "headwater_capture_phase", phase="starting") == 1
    conn = psycopg2.connect(pg_database)
    conn.autocommit = True
    watch = SlotWatch(cfg, metrics)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (unique_name,))
            cur.execute("CREATE TABLE filler AS SELECT g, repeat('x', 100) AS t FROM generate_series(1, 20000) g")
        watch.start()
        assert wait_until(lambda: maybe(exposition(metrics), "headwater_capture_slot_retained_bytes"), 10)
        seen = exposition(metrics)
        assert value(seen, "headwater_capture_slot_retained_bytes") > 2_000_000  # the table's WAL, kept for the slot
        assert value(seen, "headwater_capture_slot_lag_bytes") > 2_000_000
        assert value(seen, "headwater_capture_server_lsn") > value(seen, "headwater_capture_confirmed_lsn") > 0
    finally:
        watch.stop()
        with conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (unique_name,))
        conn.close()
    assert not watch.is_alive()


@pytest.mark.unit
def test_health_fails_once_captures_thread_is_silent_longer_than_it_may_wait() -> None:
    """/health stays 200 while capture's thread gives signs of life (a report, a look at Kafka while it
    waits on a full queue, snapshot progress), and fails past message.timeout.ms and a minute."""
    cfg = CaptureConfig(dsn=Secret("postgresql:///unused"), producer=Settings({"message.timeout.ms": "30000"}))
    metrics = CaptureMetrics(cfg)
    probe = Probe(cfg, metrics)
    assert metrics.wedged_after == 120  # 60 s at least, and a minute more
    statuses: list[str] = []
    body = json.loads(probe.app({"PATH_INFO": "/health"}, lambda status, headers: statuses.append(status))[0])
    assert statuses[-1].startswith("200") and body["status"] == "alive" and body["phase"] == "starting"
    metrics.beat_at -= 121  # nothing from capture's thread for two minutes
    body = json.loads(probe.app({"PATH_INFO": "/health"}, lambda status, headers: statuses.append(status))[0])
    assert statuses[-1].startswith("503") and body["status"] == "wedged" and body["silent_seconds"] >= 121
    metrics.snapshot_rows("snapshot", "public.t", 10, 100)  # progress is a sign of life
    assert probe.app({"PATH_INFO": "/health"}, lambda status, headers: statuses.append(status))
    assert statuses[-1].startswith("200")
    never = CaptureConfig(dsn=Secret("postgresql:///unused"), producer=Settings({"message.timeout.ms": "0"}))
    assert CaptureMetrics(never).wedged_after is None  # messages that never time out may be waited for forever


@pytest.mark.slow
def test_changes_are_counted_once_kafka_acknowledged_them(proxied_broker: ProxiedBroker, unique_name: str,
                                                          tmp_path: Path) -> None:  # fmt: skip
    """Sent while the broker is cut off: not counted (nor are delivery errors) until Kafka answers; a message
    that times out is a delivery error at the next look, not only when the session ends."""
    cfg = CaptureConfig(dsn=Secret("postgresql:///unused"), bootstrap=proxied_broker.bootstrap, format="json",
                        topic_prefix=unique_name, producer=Settings({"message.timeout.ms": "3000"}))  # fmt: skip
    ensure_changes_topic(cfg)
    producer, metrics = ChangeProducer(cfg), CaptureMetrics(cfg)
    sink = ChangeSink(change_writer("json", 0, 0), producer)

    def transaction(changes: int, lsn: int) -> None:
        tx = TxBuffer(1 << 20, tmp_path)
        for n in range(changes):
            tx.add(RowChange("INSERT", "public", "t", f"{unique_name}.t", b'{"id":%d}' % n, None, b"{}"))
        sink.emit_transaction(tx, lsn, lsn + 1, 1, 0)

    def counted() -> tuple[float, float, float]:
        found = exposition(metrics)
        return (maybe(found, "headwater_capture_events_total", table="public.t", op="INSERT") or 0,
                value(found, "headwater_capture_transactions_total"),
                value(found, "headwater_capture_delivery_errors_total"))  # fmt: skip

    proxied_broker.proxy.cut()
    transaction(3, 100)
    metrics.count(sink, producer)
    assert counted() == (0, 0, 0), "counted before Kafka acknowledged"
    proxied_broker.proxy.restore()
    producer.flush(30)
    metrics.count(sink, producer)
    assert counted() == (3, 1, 0)
    proxied_broker.proxy.cut()
    transaction(2, 200)
    time.sleep(4)  # message.timeout.ms passes; librdkafka reports the expiry at a scan of its own, a moment later
    deadline = time.monotonic() + 20  # on a loaded machine (a CI leg on 3.13) 0.5 s more was not always enough
    while True:
        producer.poll(0.5)
        metrics.watch_producer(producer, time.monotonic())
        metrics.count(sink, producer)
        if counted()[2] or time.monotonic() > deadline:
            break
    assert counted() == (3, 1, 2), "timed-out messages: delivery errors at once, never counted as written"
    proxied_broker.proxy.restore()


def exposition(metrics: CaptureMetrics) -> Samples:
    """Every sample of a ``CaptureMetrics`` as Prometheus would scrape it."""
    from prometheus_client import generate_latest

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for s in family.samples}  # fmt: skip


def wait_until(check: Callable[[], Any], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.unit
def test_both_formats_count_changes_by_table_and_operation_until_taken() -> None:
    changes = [("INSERT", "public", "t", "p.t", b"{}", None, b"{}")] * 3 + [("DELETE", "s", "u", "p.s.u", b"{}", None,
                                                                              None)]  # fmt: skip
    for writer in (change_writer("json", 0, 0), change_writer("avro", 1, 2)):
        list(writer.records(changes, writer.transaction(1, 2, 3), writer.size(len(changes))))
        assert writer.take_counts() == {("public", "t", "INSERT"): 3, ("s", "u", "DELETE"): 1}
        assert writer.take_counts() == {}
