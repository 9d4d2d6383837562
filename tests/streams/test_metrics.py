"""A worker's /metrics, /health and /ready under the shop's load, its log lines, and the pure watches behind them."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from headwater import shop
from streams.metrics import CutWatch, KafkaWatch, StreamsMetrics
from tables.logs import KAFKA_GATE
from tests.capture.test_metrics import Samples, scrape, value
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.streams import Worker
from tests.streams.test_workers import wait_for

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


class ReadyWatch:
    """Polls a worker's /ready from before it starts until stopped: (status, reason) of each answer."""

    def __init__(self, url: str) -> None:
        self.url, self.seen = url, []  # type: ignore[var-annotated]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                answer = httpx.get(self.url + "/ready", timeout=5)
                self.seen.append((answer.status_code, answer.json()["reason"]))
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.05)

    def until_ready(self, timeout: float = 90) -> list[tuple[int, str | None]]:
        assert wait_for(lambda: self.seen and self.seen[-1][0] == 200, timeout), self.seen[-3:]
        self.stopping.set()
        self.thread.join()
        return list(self.seen)


def table_rows(samples: Samples, prefix: str, table: str) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == "headwater_streams_table_rows" and dict(labels)["topic"] == f"{prefix}.{table}")  # fmt: skip


@pytest.mark.slow
def test_worker_metrics_move_and_it_is_ready_once_loaded(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    prefix = capture.cfg.topic_prefix
    writer = ShopWriter(pg_database, rate=80).start()
    time.sleep(2)
    worker = worker_factory(prefix, views=shop.VIEWS_TOML)
    watch = ReadyWatch(worker.url)
    worker.start()
    seen = watch.until_ready()
    reasons = {reason for status, reason in seen if status == 503}
    assert reasons, f"never 503 before ready: {seen[:5]}"
    known = ("waiting for the consumer group", "rebalancing", "recovering", "loading tables", "the fan-out is at",
             "the views replay")  # fmt: skip
    assert all(r.startswith(known) for r in reasons), reasons
    assert {status for status, _ in seen} == {200, 503}
    assert worker.get("/health").json() == {"status": "alive"}

    first = scrape(worker.url)
    time.sleep(4)
    second = scrape(worker.url)
    fanned = "headwater_streams_fanout_changes_total"
    assert value(second, fanned) > value(first, fanned) > 0
    assert value(second, "headwater_streams_fanout_records_total") > 0
    assert value(second, "headwater_streams_view_changes_total") > value(first, "headwater_streams_view_changes_total")
    for reader in ("fan-out", "views"):
        assert value(second, "headwater_streams_raw_offset", reader=reader) > value(
            first, "headwater_streams_raw_offset", reader=reader)  # fmt: skip
        assert 0 <= value(second, "headwater_streams_raw_lag_messages", reader=reader) < 5000
    assert value(second, "headwater_streams_view_cut_lsn") > value(first, "headwater_streams_view_cut_lsn") > 0
    assert 0 <= value(second, "headwater_streams_view_cut_age_seconds") < 30
    writer.stop()
    capture.wait_caught_up(pg_database)

    counts = shop.counts(shop_db)

    def loaded() -> bool:
        last = scrape(worker.url)
        return all(table_rows(last, prefix, t) == counts[t] for t in shop.KEYS)

    assert wait_for(loaded, 60, every=0.5), "table rows do not reach PostgreSQL's counts"
    end = scrape(worker.url)
    assert all(v == 1 for (name, _), v in end.items() if name == "headwater_streams_table_loaded")
    cut = value(end, "headwater_streams_view_cut_lsn")
    assert wait_for(lambda: value(scrape(worker.url), "headwater_streams_redis_cut_lsn", view="orders_enriched") == cut,
                    30), "Redis does not reach the views' cut"  # fmt: skip
    with shop_db.cursor() as cur:
        cur.execute("SELECT min(id) FROM customers")
        customer = cur.fetchone()[0]
    assert worker.get(f"/tables/customers/{customer}").status_code == 200
    assert worker.get("/tables/customers/999999999").status_code == 404
    after = scrape(worker.url)
    page = "/tables/{name}/{key}"
    assert value(after, "headwater_streams_http_requests_total", page=page, status="200") >= 1
    assert value(after, "headwater_streams_http_requests_total", page=page, status="404") >= 1
    assert value(after, "headwater_streams_http_requests_total", page="/ready", status="503") >= 1
    assert value(after, "headwater_streams_dead_letters_total") == 0


@pytest.mark.slow
def test_worker_logs_json_lines_at_the_level_asked(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    worker = worker_factory(capture.cfg.topic_prefix, environ={"HEADWATER_LOG_FORMAT": "json"})
    worker.start()
    assert wait_for(lambda: "reading " + capture.cfg.changes_topic in worker.log.read_text(), 30)
    worker.kill(15)
    lines = worker.log.read_text().splitlines()
    assert not [line for line in lines if TEXT_LINE.match(line)], "a text line in the JSON log"
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert all(r["component"] == "streams" and {"time", "level", "logger", "message"} <= set(r) for r in records)
    reading = next(r for r in records if r["message"].startswith("headwater-feed-fan-out: reading"))
    assert reading["topic"] == capture.cfg.changes_topic and isinstance(reading["offset"], int)
    assert any(r["level"] == "WARNING" and r["message"].startswith("streams worker starting") for r in records)
    assert any(r["message"].startswith("streams worker stopped") for r in records)
    assert any(r["logger"].startswith(("faust", "mode")) for r in records), "Faust's own lines in the same format"

    quiet = worker_factory(capture.cfg.topic_prefix, environ={"HEADWATER_LOG_LEVEL": "warning"})
    quiet.loglevel = None  # no -l: the environment decides
    quiet.start()
    assert wait_for(lambda: quiet.get("/ready").status_code == 200, 60)
    quiet.kill(15)
    text = [line for line in quiet.log.read_text().splitlines() if TEXT_LINE.match(line)]
    assert text and all(" INFO " not in line and " DEBUG " not in line for line in text), text[:5]
    assert any("streams worker starting" in line for line in text)


# ---- the pure parts ----------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_cut_age_is_zero_while_the_cut_holds_everything(caplog: pytest.LogCaptureFixture) -> None:
    watch = CutWatch(warn_after=10)
    with caplog.at_level(logging.WARNING, logger="headwater.streams"):
        watch.observe(100, False, 0)
        assert watch.age(5) == 0
        watch.observe(100, True, 5)  # changes wait for the next cut
        assert watch.age(8) == 3
        watch.observe(200, True, 8)  # the cut moved, more waits: counted from the move
        assert watch.age(9) == 1
        for now in range(9, 30):
            watch.observe(200, True, now)  # stuck: one warning at 18
        watch.observe(300, False, 31)
        assert watch.age(40) == 0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "has not moved for 10 s" in said[0] and "moves again (now at 0/12C)" in said[1]


@pytest.mark.unit
def test_kafka_connection_failures_are_said_once_when_they_last(caplog: pytest.LogCaptureFixture) -> None:
    watch = KafkaWatch("127.0.0.1:1", after=5, quiet=15)
    with caplog.at_level(logging.WARNING, logger="headwater.streams"):
        start = time.monotonic()
        for second in range(8):  # a failure a second for 8 s, the watch looking every second
            KAFKA_GATE.seen("Connect to ipv4#127.0.0.1:1 failed: Connection refused", start + second)
            watch.check(start + second)
        for second in range(8, 30):
            watch.check(start + second)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "unreachable for 5 s" in said[0] and "answers again" in said[1], said


@pytest.mark.unit
def test_fanout_counters_are_added_per_batch_and_survive_a_new_fanout() -> None:
    from streams.fanout import Counters

    metrics = StreamsMetrics()
    counters = Counters(changes=10, written=8, duplicates=1, skipped=1)
    metrics.fanned(counters)
    counters.changes, counters.written = 15, 12
    metrics.fanned(counters)
    metrics.fanned(Counters(changes=3, written=3))  # a rebalance made a new FanOut
    assert metrics.changes._value.get() == 18 and metrics.records._value.get() == 15
