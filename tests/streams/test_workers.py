"""The stream workers on the real stack: capture → raw topic → fan-out → table topics, tables, endpoint."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from confluent_kafka import Producer

from headwater import shop
from headwater.reconcile import compare, compare_endpoint, latest_rows
from tables.config import StackConfig
from tables.kafka import read_topic
from tables.registry import Registry
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.streams import Worker

pytestmark = pytest.mark.slow


def wait_for(check: Callable[[], Any], timeout: float = 30.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(every)


def problems(conn: Any, capture: Capture, workers: list[Worker]) -> list[str]:
    """PostgreSQL against each table topic's latest state and against every worker's endpoint."""
    decode = Registry(capture.cfg.registry_url)
    found: list[str] = []
    for table, key in shop.KEYS.items():
        topic = f"{capture.cfg.topic_prefix}.{table}"
        found += compare(conn, table, key, latest_rows(capture.cfg.bootstrap, topic, decode))[1]
        for worker in workers:
            found += compare_endpoint(conn, table, key, worker.url, table)[1]
    return found


def sent_twice(capture: Capture) -> int:
    """How many streamed changes the raw topic holds more than once (same commit LSN and position)."""
    idents = [(c["commit_lsn"], c["position"]) for c in capture.changes() if c["op"] != "READ"]
    return len(idents) - len(set(idents))


def second_copies(capture: Capture) -> list[tuple[Any, ...]]:
    """Records written twice for the same change: same topic, key, commit LSN and position."""
    seen: Counter[tuple[Any, ...]] = Counter()
    for table in shop.KEYS:
        topic = f"{capture.cfg.topic_prefix}.{table}"
        for record in read_topic(capture.cfg.bootstrap, topic):
            headers = dict(record.headers)
            seen[(topic, record.key, headers.get("hw.lsn"), headers.get("hw.pos"))] += 1
    return [ident for ident, count in seen.items() if count > 1]


def reconciled(conn: Any, capture: Capture, workers: list[Worker], timeout: float = 60.0) -> None:
    last: list[str] = []

    def check() -> bool:
        nonlocal last
        last = problems(conn, capture, workers)
        return not last

    assert wait_for(check, timeout, every=1.0), "\n".join(last[:20])


class Watch:
    """Asks one URL every 20 ms in a thread: the (status, Retry-After) of every answer, in order."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[int, str | None]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._ask, daemon=True)
        self.thread.start()

    def _ask(self) -> None:
        while not self.done.wait(0.02):
            try:
                r = httpx.get(self.url, timeout=5)
            except httpx.HTTPError:
                continue
            self.answers.append((r.status_code, r.headers.get("retry-after")))

    def stop(self) -> list[tuple[int, str | None]]:
        self.done.set()
        self.thread.join()
        return self.answers


def pipeline(shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture],
             worker_factory: Callable[..., Worker], **settings: Any) -> tuple[Capture, Worker]:  # fmt: skip
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    return capture, worker_factory(capture.cfg.topic_prefix, **settings).start()


def test_insert_update_delete_reach_topic_and_endpoint_within_2s(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    capture, worker = pipeline(shop_db, pg_database, capture_factory, worker_factory)
    reconciled(shop_db, capture, [worker])
    with shop_db.cursor() as cur:
        cur.execute("INSERT INTO customers (email, name, region) VALUES ('new@x.io', 'New', 'north') RETURNING id")
        new_id = cur.fetchone()[0]
    shop_db.commit()
    started = time.monotonic()
    answer = wait_for(lambda: worker.get(f"/tables/customers/{new_id}").status_code == 200, timeout=5)
    assert answer and time.monotonic() - started < 2.0, "insert not served within 2 s"
    assert worker.get(f"/tables/customers/{new_id}").json()["row"]["email"] == "new@x.io"

    with shop_db.cursor() as cur:
        cur.execute("UPDATE customers SET name = 'Renamed' WHERE id = %s", (new_id,))
    shop_db.commit()
    started = time.monotonic()
    renamed = wait_for(lambda: worker.get(f"/tables/customers/{new_id}").json()["row"]["name"] == "Renamed", 5)
    assert renamed and time.monotonic() - started < 2.0, "update not served within 2 s"

    with shop_db.cursor() as cur:
        cur.execute("DELETE FROM customers WHERE id = %s", (new_id,))
    shop_db.commit()
    started = time.monotonic()
    assert wait_for(lambda: worker.get(f"/tables/customers/{new_id}").status_code == 404, timeout=5)
    assert time.monotonic() - started < 2.0, "delete not served within 2 s"

    records = [r for r in read_topic(capture.cfg.bootstrap, f"{capture.cfg.topic_prefix}.customers")]
    mine = [r for r in records if r.key is not None and Registry(capture.cfg.registry_url)(r.key)["id"] == new_id]
    assert [r.value is None for r in mine] == [False, False, True], "insert, update, then a tombstone"
    assert len({r.partition for r in mine}) == 1, "one key, one partition"


def test_key_change_truncate_and_bad_requests(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    capture, worker = pipeline(shop_db, pg_database, capture_factory, worker_factory)
    with shop_db.cursor() as cur:
        cur.execute(
            "UPDATE order_items SET line_no = line_no + 100 WHERE order_id = (SELECT min(order_id) FROM order_items)"
        )
    shop_db.commit()
    reconciled(shop_db, capture, [worker])  # the old keys are tombstoned, the new ones present

    assert worker.get("/tables/nope/1").status_code == 404
    # a key no row has: 404 once its partition has read what its last fetch reported (503 until then)
    answers: list[httpx.Response] = []

    def answered() -> bool:
        answers.append(worker.get("/tables/customers/999999"))
        return answers[-1].status_code != 503

    wait_for(answered, 10)
    assert answers[-1].status_code == 404, answers[-1].text
    assert worker.get("/tables/customers/abc").status_code == 400
    assert worker.get("/tables/order_items/1").status_code == 400  # two key columns
    listed = {t["name"]: t for t in worker.get("/tables/").json()["tables"]}
    assert set(listed) == set(shop.KEYS) and listed["order_items"]["key"] == ["order_id", "line_no"]
    agents = subprocess.run([sys.executable, "-m", "faust", "-A", "streams", "agents"], env=worker.env,
                            cwd=worker.log.parent, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert agents.returncode == 0, agents.stderr
    assert "@raw" in agents.stdout and f"{capture.cfg.topic_prefix}.changes" in agents.stdout
    assert "@table_rows" in agents.stdout and f"{capture.cfg.topic_prefix}.order_items" in agents.stdout

    with shop_db.cursor() as cur:
        cur.execute("TRUNCATE order_items")
        cur.execute("INSERT INTO order_items SELECT o.id, 1, p.id, 2, p.price FROM orders o, products p "
                    "WHERE o.id = (SELECT min(id) FROM orders) AND p.id = (SELECT min(id) FROM products)")  # fmt: skip
    shop_db.commit()
    reconciled(shop_db, capture, [worker])  # one row left: everything before the truncate is tombstoned


def test_two_workers_answer_every_key(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    capture, first = pipeline(shop_db, pg_database, capture_factory, worker_factory)
    reconciled(shop_db, capture, [first])
    with shop_db.cursor() as cur:
        cur.execute("SELECT min(id) FROM customers")
        answers = Watch(f"{first.url}/tables/customers/{cur.fetchone()[0]}")
    second = worker_factory(capture.cfg.topic_prefix).start()
    time.sleep(8)  # the group rebalances across both workers
    statuses = answers.stop()
    seen = [status for status, _ in statuses]
    assert 503 in seen and seen[-1] == 200, f"no 503 while rebalancing, or no 200 after it: {sorted(set(seen))}"
    assert set(seen) <= {200, 503}, f"answers during the rebalance: {sorted(set(seen))}"
    assert all(retry == "2" for status, retry in statuses if status == 503), "a 503 without Retry-After"
    reconciled(shop_db, capture, [first, second], timeout=90)
    here = [sum(t["rows_here"] for t in w.get("/tables/").json()["tables"]) for w in (first, second)]
    assert all(here), f"both workers hold rows: {here}"
    assert sum(here) == sum(shop.counts(shop_db).values())
    feeding = ["reading " + capture.cfg.changes_topic in w.log.read_text() for w in (first, second)]
    assert feeding.count(True) >= 1
    assert not any("Faust delivered raw offset" in w.log.read_text() for w in (first, second))


def test_a_worker_stays_in_its_group_past_the_max_poll_interval_and_keeps_serving_changes(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    """Faust delivers a worker nothing (the engine reads its topics itself); aiokafka counted that as idle and
    left the group after broker_max_poll_interval (1000 s) from the start, for good. Here the interval is 10 s."""
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    worker = worker_factory(capture.cfg.topic_prefix, environ={"BROKER_MAX_POLL_INTERVAL": "10"}).start()
    reconciled(shop_db, capture, [worker])
    time.sleep(25)
    with shop_db, shop_db.cursor() as cur:
        cur.execute("UPDATE customers SET name = 'after the interval' WHERE id = (SELECT min(id) FROM customers)")
    reconciled(shop_db, capture, [worker], timeout=30)
    assert "LeaveGroup" not in worker.log.read_text(), worker.tail()


def test_kill9_worker_under_load_then_replay_from_zero_changes_nothing(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    unique_name: str, shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    capture, worker = pipeline(shop_db, pg_database, capture_factory, worker_factory, batch_size=50)
    load = shop_writer(rate=150)
    for _ in range(2):
        time.sleep(2.5)
        worker.kill(signal.SIGKILL)
        worker.start()
    time.sleep(2)
    assert load.stop() > 300
    capture.wait_caught_up(pg_database)
    reconciled(shop_db, capture, [worker], timeout=90)
    assert not second_copies(capture)

    prefix = capture.cfg.topic_prefix
    before = {t: read_topic(capture.cfg.bootstrap, f"{prefix}.{t}") for t in shop.KEYS}
    fresh = worker_factory(prefix, app_id=f"{unique_name}-fresh").start()  # a new group: reads from offset 0
    raw_end = len(read_topic(capture.cfg.bootstrap, capture.cfg.changes_topic))
    worker.kill(signal.SIGTERM)
    assert wait_for(lambda: fresh.counters().get("changes", -1) >= 0, timeout=30)
    time.sleep(3)
    after = {t: read_topic(capture.cfg.bootstrap, f"{prefix}.{t}") for t in shop.KEYS}
    assert {t: len(r) for t, r in after.items()} == {t: len(r) for t, r in before.items()}, "replay wrote records"
    reconciled(shop_db, capture, [fresh])
    assert raw_end > 0


def test_undecodable_raw_message_goes_to_dead_letter_topic(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig,
) -> None:  # fmt: skip
    capture, worker = pipeline(shop_db, pg_database, capture_factory, worker_factory)
    producer = Producer({"bootstrap.servers": local_stack.bootstrap})
    producer.produce(capture.cfg.changes_topic, b"not avro at all", b"k")
    producer.produce(capture.cfg.changes_topic, b"\x00\x00\x01\x86\xa0garbage", b"k2")  # unknown schema id
    assert producer.flush(10) == 0
    with shop_db.cursor() as cur:
        cur.execute("UPDATE products SET name = 'after the bad ones' WHERE id = (SELECT min(id) FROM products)")
    shop_db.commit()
    reconciled(shop_db, capture, [worker])  # the stream went on past them

    dead = read_topic(capture.cfg.bootstrap, capture.cfg.changes_topic + ".dlq")
    assert [r.value for r in dead] == [b"not avro at all", b"\x00\x00\x01\x86\xa0garbage"]
    counters = worker.counters()
    assert counters["dead_letters"] == 2
    raw = read_topic(capture.cfg.bootstrap, capture.cfg.changes_topic)
    bad_offsets = [r.offset for r in raw if r.key in (b"k", b"k2")]
    where = [dict(r.headers) for r in dead]
    assert [int(h["hw.source.offset"]) for h in where] == bad_offsets
    assert b"Confluent wire format" in where[0]["hw.error"] and b"not in the registry" in where[1]["hw.error"]
    log = worker.log.read_text()
    assert all(f"offset {o} cannot be decoded" in log for o in bad_offsets)


def test_capture_killed_and_replaying_adds_no_second_copies(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    shop_writer: Callable[..., ShopWriter]
) -> None:
    capture = capture_factory(pg_database)
    capture.spawn()
    capture.wait_caught_up(pg_database)
    worker = worker_factory(capture.cfg.topic_prefix).start()
    load = shop_writer(rate=200)
    replayed = 0
    for _ in range(10):  # until capture has sent some changes twice (it replays from the last confirmed commit)
        time.sleep(random.uniform(1.0, 2.5))
        assert capture.process is not None
        capture.process.kill()
        capture.process.wait()
        sent = len(capture.changes())
        capture.spawn()  # its first sends are the replay: wait for them, or a slow start is killed before them
        assert wait_for(lambda sent=sent: len(capture.changes()) > sent, 60, every=0.5), "capture did not stream again"
        replayed = sent_twice(capture)
        if replayed:
            break
    load.stop()
    capture.wait_caught_up(pg_database)
    assert replayed, "capture never replayed a change: the scenario did not happen"
    reconciled(shop_db, capture, [worker], timeout=90)
    assert not second_copies(capture)
    assert worker.counters()["duplicates"] >= replayed
