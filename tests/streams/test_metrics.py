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
from streams.metrics import CutWatch, KafkaWatch, StreamsMetrics, silence
from tables.kafka import bounds, reader
from tests.capture.test_metrics import Samples, maybe, scrape, value
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.stack import ProxiedBroker
from tests.plugins.streams import Worker
from tests.streams.test_workers import wait_for

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


class ReadyWatch:
    """Polls a worker's /ready from before it starts until stopped: (status, reason) of each answer."""

    def __init__(self, url: str, every: float = 0.05) -> None:
        self.url, self.every, self.seen = url, every, []  # type: ignore[var-annotated]
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
            time.sleep(self.every)

    def until_ready(self, timeout: float = 90) -> list[tuple[int, str | None]]:
        assert wait_for(lambda: self.seen and self.seen[-1][0] == 200, timeout), self.seen[-3:]
        self.stopping.set()
        self.thread.join()
        return list(self.seen)


def table_rows(samples: Samples, prefix: str, table: str) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == "headwater_streams_table_rows" and dict(labels)["topic"] == f"{prefix}.{table}")  # fmt: skip


def captured(pg_database: str, capture_factory: Callable[..., Capture], **settings: Any) -> Capture:
    """Capture started on the test's database and caught up (the shop's snapshot is on the raw topic)."""
    capture = capture_factory(pg_database, **settings).start()
    capture.wait_caught_up(pg_database)
    return capture


@pytest.mark.slow
def test_worker_metrics_move_and_it_is_ready_once_loaded(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    shop_writer: Callable[..., ShopWriter]
) -> None:
    capture = captured(pg_database, capture_factory)
    prefix = capture.cfg.topic_prefix
    writer = shop_writer(rate=80)
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
    moving(worker)
    writer.stop()
    capture.wait_caught_up(pg_database)
    loaded_and_served(worker, shop_db, prefix, capture)


def moving(worker: Worker) -> None:
    """Under load, two scrapes 4 s apart: counters, positions and the cut move; lags are what they say. The
    first waits for the views' first cut (ready may come before it when the machine is busy)."""
    cut = "headwater_streams_view_cut_lsn"
    assert wait_for(lambda: maybe(scrape(worker.url), cut) is not None, 30, every=0.2), "no view cut in 30 s"
    first = scrape(worker.url)
    time.sleep(4)
    second = scrape(worker.url)
    fanned = "headwater_streams_fanout_changes_total"
    assert value(second, fanned) > value(first, fanned) > 0
    assert value(second, "headwater_streams_fanout_records_total") > 0
    assert value(second, "headwater_streams_view_changes_total") > value(first, "headwater_streams_view_changes_total")
    for name in ("fan-out", "views"):
        at, end = (value(second, f"headwater_streams_raw_{n}", reader=name) for n in ("offset", "end_offset"))
        assert at > value(first, "headwater_streams_raw_offset", reader=name) and end >= at
        assert value(second, "headwater_streams_raw_lag_messages", reader=name) == end - at
    assert value(second, cut) > value(first, cut) > 0
    assert 0 <= value(second, "headwater_streams_view_cut_age_seconds") < 30
    assert value(second, "headwater_streams_broker_reachable") == 1


def loaded_and_served(worker: Worker, shop_db: Any, prefix: str, capture: Capture) -> None:
    """At rest: every table's rows, every partition loaded and read to the topic's end, Redis at the cut, and
    the endpoint's answers counted by status."""
    counts = shop.counts(shop_db)

    def loaded() -> bool:
        last = scrape(worker.url)
        return all(table_rows(last, prefix, t) == counts[t] for t in shop.KEYS)

    assert wait_for(loaded, 60, every=0.5), "table rows do not reach PostgreSQL's counts"
    end = scrape(worker.url)
    assert all(v == 1 for (name, _), v in end.items() if name == "headwater_streams_table_loaded")
    ends = topic_ends(capture.cfg.bootstrap, [f"{prefix}.{t}" for t in shop.KEYS])
    for (name, labels), v in end.items():
        if name == "headwater_streams_table_offset":
            where = dict(labels)
            assert v == ends[(where["topic"], int(where["partition"]))], where  # read to the topic's true end
    raw_end = topic_ends(capture.cfg.bootstrap, [capture.cfg.changes_topic])[(capture.cfg.changes_topic, 0)]
    assert value(end, "headwater_streams_raw_end_offset", reader="fan-out") == raw_end > 0
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


def topic_ends(bootstrap: str, topics: list[str]) -> dict[tuple[str, int], int]:
    """Each partition's true end (fetched to partition EOF: right on the local broker too)."""
    consumer = reader({"bootstrap.servers": bootstrap})
    try:
        found = consumer.list_topics(timeout=10).topics
        return {(t, p): bounds({"bootstrap.servers": bootstrap}, t, p)[1] for t in topics for p in found[t].partitions}
    finally:
        consumer.close()


@pytest.mark.slow
def test_ready_stays_ready_while_changes_stream_in(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    shop_writer: Callable[..., ShopWriter]
) -> None:
    """A loaded worker whose partitions get records all the time, and now and then more than one read takes,
    is ready all the time (and its partitions stay loaded): readiness is not "read to the end of the last
    fetch" at every instant."""
    capture = captured(pg_database, capture_factory)
    worker = worker_factory(capture.cfg.topic_prefix).start()
    assert wait_for(lambda: worker.get("/ready").status_code == 200, 60)
    writer = shop_writer(rate=200)
    watch = ReadyWatch(worker.url, every=0.01)
    loaded: set[float] = set()
    try:
        for burst in range(4):
            with shop_db.cursor() as cur:  # 20,000 customers in one transaction: 5,000 a partition
                cur.execute("INSERT INTO customers (email, name, region) SELECT 'burst%s-' || g || '@example.com', "
                            "'n' || g, 'eu' FROM generate_series(1, 20000) g", (burst,))  # fmt: skip
            shop_db.commit()
            for _ in range(12):
                time.sleep(0.25)
                loaded |= {v for (n, _), v in scrape(worker.url).items() if n == "headwater_streams_table_loaded"}
    finally:
        watch.stopping.set()
        watch.thread.join()
        committed = writer.stop()
    assert committed > 1000 and len(watch.seen) > 50
    assert {status for status, _ in watch.seen} == {200}, [s for s in watch.seen if s[0] != 200][:5]
    assert loaded == {1.0}


@pytest.mark.slow
def test_worker_logs_json_lines_at_the_level_asked(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    capture = captured(pg_database, capture_factory)
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
    assert not any("did not end within" in r["message"] for r in records), "a normal stop cut short"
    assert any(r["logger"].startswith(("faust", "mode")) for r in records), "Faust's own lines in the same format"

    quiet = worker_factory(capture.cfg.topic_prefix, environ={"HEADWATER_LOG_LEVEL": "warning"})
    quiet.loglevel = None  # no -l: the environment decides
    quiet.start()
    assert wait_for(lambda: quiet.get("/ready").status_code == 200, 60)
    quiet.kill(15)
    text = [line for line in quiet.log.read_text().splitlines() if TEXT_LINE.match(line)]
    assert text and all(" INFO " not in line and " DEBUG " not in line for line in text), text[:5]
    assert any("streams worker starting" in line for line in text)


@pytest.mark.slow
def test_a_broker_away_is_said_once_by_a_worker(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], proxied_broker: ProxiedBroker,
    worker_factory: Callable[..., Worker], shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    """Connections dropped and refused for 12 s, then the broker paused (SIGSTOP) for 12 s, under load: the
    worker says each once when it begins and once when it ends (librdkafka says an identical connection
    failure at most every 30 s: the workers judge by its statistics, not its log), and catches up after.
    The broker is set up before the worker, so the worker is stopped first: stopped after it, with the proxy
    closing, Faust's own consumer (aiokafka's fetcher) once hung its shutdown past the 60 s the test waits (CI,
    2026-11-30, after Headwater's engine had closed); four workers stopped with their broker gone took 6.2-6.4 s."""
    capture = captured(pg_database, capture_factory, bootstrap=proxied_broker.bootstrap, on_error="log")
    prefix = capture.cfg.topic_prefix
    worker = worker_factory(prefix, bootstrap=proxied_broker.bootstrap, broker_profile="tansu").start()
    assert wait_for(lambda: worker.get("/ready").status_code == 200, 60), worker.tail()

    def said() -> tuple[list[str], list[str], list[str]]:
        lines = worker.log.read_text().splitlines()
        began = [line for line in lines if re.search(r"Kafka at \S+ (unreachable for|does not answer)", line)]
        ended = [line for line in lines if re.search(r"Kafka at \S+ answers", line)]
        return began, ended, [line for line in lines if " ERROR " in line and "aiokafka" in line]

    def back() -> None:
        """The first outage said over before the second begins: on a busy machine the readers' reconnects (backing
        off) took longer than a fixed 5 s, and the two outages were said as one (CI, 2026-11-29)."""
        wait_for(lambda: len(said()[1]) >= 1, 60, every=0.5)
        time.sleep(3)

    writer = shop_writer(rate=50)
    time.sleep(2)
    seen = proxied_broker.outages(lambda _: time.sleep(2) or scrape(worker.url), between=back)
    writer.stop()
    capture.wait_caught_up(pg_database, timeout=120)
    counts = shop.counts(shop_db)
    assert wait_for(lambda: all(table_rows(scrape(worker.url), prefix, t) == counts[t] for t in shop.KEYS), 120,
                    every=1), "the worker does not catch up after the outages"  # fmt: skip

    assert wait_for(lambda: len(said()[1]) >= 2, 30), "\n".join(said()[0] + said()[1]) or worker.tail()
    began, ended, noise = said()
    assert len(began) == 2 and len(ended) == 2, "\n".join(began + ended)
    assert all(" WARNING " in line for line in began + ended)
    assert len(noise) < 10, "Faust's client's connection errors:\n" + "\n".join(noise[:10])
    for samples in seen.values():
        assert value(samples, "headwater_streams_broker_reachable") == 0
    assert value(scrape(worker.url), "headwater_streams_broker_reachable") == 1


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
def test_no_cut_yet_is_said_as_a_first_build_not_as_older_data(caplog: pytest.LogCaptureFixture) -> None:
    """A big view's first build takes minutes: past ``warn_after`` the warning says readers see none of its rows
    yet (not "older data"), and the first cut ends it."""
    watch = CutWatch(warn_after=10)
    with caplog.at_level(logging.WARNING, logger="headwater.streams"):
        for now in range(0, 15):
            watch.observe(None, True, now)
        watch.observe(300, False, 16)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "no cut yet after 10 s" in said[0] and "see none of their rows" in said[0]
    assert "older data" not in said[0] and "moves again (now at 0/12C)" in said[1]


def stats(**brokers: dict[str, Any]) -> str:
    """librdkafka's statistics (the part the watch reads), as the consumer's stats_cb gets them."""
    return json.dumps({"name": "rdkafka#consumer-1", "type": "consumer", "brokers": brokers})


UP = {"source": "learned", "state": "UP", "waitresp_cnt": 1, "rxidle": 8_000}  # a fetch out for 8 ms
BOOTSTRAP = {"source": "configured", "state": "INIT", "waitresp_cnt": 0, "rxidle": -1}
INTERNAL = {"source": "internal", "state": "UP", "waitresp_cnt": 0, "rxidle": -1}


@pytest.mark.unit
def test_silence_is_no_connection_up_or_requests_unanswered() -> None:
    assert silence({"a/1": UP, "a/bootstrap": BOOTSTRAP, ":0/internal": INTERNAL}, 2.5) is None
    assert silence({"a/1": {**UP, "waitresp_cnt": 0, "rxidle": 600_000_000}}, 2.5) is None  # idle, nothing asked
    down = silence({"a/1": {**UP, "state": "CONNECT"}, "a/bootstrap": BOOTSTRAP, ":0/internal": INTERNAL}, 2.5)
    assert down == (0.0, "no broker connection up (CONNECT, INIT)")
    paused = silence({"a/1": {**UP, "rxidle": 7_400_000}}, 2.5)  # a fetch unanswered for 7.4 s
    assert paused is not None and paused[0] == 7.4 and "no answer to requests for 7 s" in paused[1]


@pytest.mark.unit
def test_kafka_not_answering_the_readers_is_said_once_when_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    """Judged from every reader that reported lately: all of them silent for 5 s is an episode; one answered
    reader is not; a reader that stopped reporting (busy in its handler) does not count either way."""
    watch = KafkaWatch("127.0.0.1:1", after=5)
    down = stats(**{"a/1": {**UP, "state": "TRY_CONNECT"}})
    with caplog.at_level(logging.WARNING, logger="headwater.streams"):
        assert watch.reachable() is None
        for second in range(10):
            watch.seen("tables", 2.5, down if second >= 2 else stats(**{"a/1": UP}), now=second)
            watch.seen("fan-out", 2.5, down if second >= 2 else stats(**{"a/1": UP}), now=min(second, 3))
            watch.check(second + 0.2)
            if second == 6:
                assert watch.reachable() == 1, "announced before 5 s"
        assert watch.reachable() == 0  # fan-out stale since 3: the table feed alone says so
        watch.seen("tables", 2.5, stats(**{"a/1": UP}), now=10)
        watch.check(10.5)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "does not answer the workers' readers (no broker connection up" in said[0], said
    assert "for 5 s" in said[0] and "answers the workers' readers again" in said[1]
    assert watch.reachable() == 1


@pytest.mark.unit
def test_fanout_counters_are_added_per_batch_and_survive_a_new_fanout() -> None:
    from streams.fanout import Counters

    metrics = StreamsMetrics()
    counters = Counters(changes=10, written=8, duplicates=1, skipped=1)
    metrics.fanned(counters)
    counters.changes, counters.written = 15, 12
    metrics.fanned(counters)
    metrics.fanned(Counters(changes=3, written=3))  # a rebalance made a new FanOut
    sample = metrics.registry.get_sample_value
    assert sample("headwater_streams_fanout_changes_total") == 18
    assert sample("headwater_streams_fanout_records_total") == 15
