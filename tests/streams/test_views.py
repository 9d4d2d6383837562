"""The views on the real stack: joins kept right under every change, published at consistent cuts, in Redis."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import subprocess
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from typing import Any

import psycopg2
import pytest
import redis
from confluent_kafka.admin import AdminClient

from capture import slot
from headwater import shop
from headwater.reconcile import (
    compare_docs,
    compare_endpoint,
    endpoint_view_docs,
    latest_view_docs,
    redis_view_docs,
    view_docs_sql,
)
from streams.rows import to_json
from tables.config import StackConfig
from tables.kafka import read_topic
from tables.registry import Registry
from tables.views import TableShape, decode_cut, parse_views
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.stack import free_port
from tests.plugins.streams import Worker
from tests.streams.test_workers import reconciled, wait_for
from tests.tables.test_views import NOTED

pytestmark = pytest.mark.slow

VIEWS = shop.VIEWS_TOML
SHAPES = {f"public.{t}": TableShape(f"public.{t}", (), tuple(k)) for t, k in shop.KEYS.items()}
SQL = parse_views(tomllib.loads(VIEWS), VIEWS)[0].sql(SHAPES)


def view_problems(conn: Any, capture: Capture, worker: Worker, redis_url: str | None, view: str = "orders_enriched",
                  sql: str = SQL) -> list[str]:  # fmt: skip
    """The SQL join in PostgreSQL against the view topic, the endpoint and Redis."""
    expected = view_docs_sql(conn, sql)
    prefix = capture.cfg.topic_prefix
    topic = latest_view_docs(capture.cfg.bootstrap, f"{prefix}.views.{view}", Registry(capture.cfg.registry_url))
    found = compare_docs(expected, topic, "topic")
    if found:
        return found
    try:
        answered = endpoint_view_docs(worker.url, view, sorted(expected))
    except AssertionError as exc:  # 503 while partitions move between workers: no answer yet
        if ": 503 " not in str(exc):
            raise
        return [str(exc)]
    found += compare_docs(expected, answered, "endpoint")
    if redis_url is not None:
        found += compare_docs(expected, redis_view_docs(redis_url, prefix, view)[0], "redis")
    return found


def views_reconciled(conn: Any, capture: Capture, worker: Worker, redis_url: str | None, timeout: float = 90,
                     view: str = "orders_enriched", sql: str = SQL, others: Sequence[Worker] = ()) -> None:  # fmt: skip
    """Until the view equals PostgreSQL's join (topic, ``worker``'s endpoint, Redis); else every worker's tail."""
    last: list[str] = []

    def check() -> bool:
        nonlocal last
        last = view_problems(conn, capture, worker, redis_url, view, sql)
        return not last

    tails = "\n".join(f"--- {w.log.name}\n{w.tail()}" for w in (worker, *others))
    assert wait_for(check, timeout, every=1.0), "\n".join(last[:20]) + "\n" + tails


def loosen(dsn: str) -> None:
    """Drop the foreign keys ``unruly`` breaks; before any writer starts (ALTER under the shop's load deadlocks)."""
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE orders DROP CONSTRAINT IF EXISTS orders_customer_id_fkey")
        cur.execute("ALTER TABLE order_items DROP CONSTRAINT IF EXISTS order_items_product_id_fkey")
    conn.close()


def unruly(dsn: str, transactions: int, seed: int) -> None:
    """Late parents and parent deletes: orders of customers that do not exist yet, customers deleted under orders
    (``loosen`` first: its ALTER here would take the tables' locks under a writer still running)."""
    conn = psycopg2.connect(dsn)
    rng = random.Random(seed)
    for n in range(transactions):
        with conn, conn.cursor() as cur:
            late = 900000 + rng.randint(0, 30)
            if rng.random() < 0.5:
                cur.execute("INSERT INTO orders (customer_id, note) VALUES (%s, 'late parent')", (late,))
            else:
                cur.execute("INSERT INTO customers (id, email, name, region) VALUES (%s, %s, 'late', 'north') "
                            "ON CONFLICT (id) DO UPDATE SET name = 'late again ' || %s",
                            (late, f"{late}@x", n))  # fmt: skip
            if rng.random() < 0.2:
                cur.execute("DELETE FROM customers WHERE id = (SELECT min(customer_id) FROM orders WHERE customer_id "
                            "IN (SELECT id FROM customers))")  # fmt: skip
            if rng.random() < 0.2:
                cur.execute("INSERT INTO order_items SELECT id, 9, 800000 + %s, 1, 1 FROM orders ORDER BY random() "
                            "LIMIT 1 ON CONFLICT DO NOTHING", (n % 5,))  # fmt: skip
            if rng.random() < 0.2:
                cur.execute("INSERT INTO products (id, sku, name, category, price, description) VALUES "
                            "(800000 + %s, %s, 'late', 'toys', 1, 'd') ON CONFLICT DO NOTHING",
                            (n % 5, f"late{n}"))  # fmt: skip
    conn.close()


def start(shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture],
          worker_factory: Callable[..., Worker], **settings: Any) -> tuple[Capture, Worker]:  # fmt: skip
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    return capture, worker_factory(capture.cfg.topic_prefix, views=VIEWS, **settings).start()


def test_randomized_workload_view_equals_the_sql_join_on_topic_endpoint_and_redis(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig, shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    capture, worker = start(shop_db, pg_database, capture_factory, worker_factory)
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    writer = shop_writer(rate=300)
    wait_for(lambda: writer.work.committed >= 1400, 60)
    committed = writer.stop()
    loosen(pg_database)
    unruly(pg_database, 600, seed=1)  # after the shop workload, whose random deletes would pick the late ids
    assert committed + 600 >= 2000, committed  # thousands of transactions, on every table
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    expected = view_docs_sql(shop_db, SQL)
    assert sum(1 for d in expected.values() if d["customer"] is None) > 10  # late and deleted parents were seen
    assert sum(1 for d in expected.values() if d["customer"] and d["customer"]["name"].startswith("late")) > 3
    assert sum(len(d["items"]) for d in expected.values()) > 50


def test_worker_killed_mid_workload_restarts_and_a_replay_changes_nothing(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig, shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    capture, worker = start(shop_db, pg_database, capture_factory, worker_factory)
    app_id = worker.env["HEADWATER_STREAMS_APP_ID"]
    loosen(pg_database)
    writer = shop_writer(rate=100)
    rng = random.Random()
    time.sleep(rng.uniform(2, 5))
    worker.kill()  # kill -9 mid-stream
    unruly(pg_database, 40, seed=rng.randint(0, 1000))
    state_dir = worker.env["HEADWATER_STREAMS_STATE_DIR"]  # the same machine: it resumes from its own state
    worker = worker_factory(capture.cfg.topic_prefix, app_id=app_id, views=VIEWS, state_dir=state_dir).start()
    time.sleep(rng.uniform(1, 3))
    writer.stop()
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    topic = f"{capture.cfg.topic_prefix}.views.orders_enriched"
    before = len(read_topic(capture.cfg.bootstrap, topic))
    worker.kill()  # at rest: a worker without state of its own replays the raw topic and must write nothing new
    worker = worker_factory(capture.cfg.topic_prefix, app_id=app_id, views=VIEWS).start()
    time.sleep(5)
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    assert len(read_topic(capture.cfg.bootstrap, topic)) == before


# 600 s: its twelve restarts each wait for the worker to be ready (5-6 s here, 115 s in all; more on a busy
# CI leg, where the whole outran the default 300 s), then the views get 120 s to converge
@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.heavy)])
def test_workers_killed_twelve_times_under_load_converge(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig, workers: int, shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    capture, first = start(shop_db, pg_database, capture_factory, worker_factory)
    app_id = first.env["HEADWATER_STREAMS_APP_ID"]
    group = [first, *(worker_factory(capture.cfg.topic_prefix, app_id=app_id, views=VIEWS).start()
                      for _ in range(workers - 1))]  # fmt: skip
    writer = shop_writer(rate=50)
    rng = random.Random(12)
    for n in range(12):  # kill -9 each in turn; each comes back on its own state (view partitions move)
        time.sleep(rng.uniform(0.5, 3))
        state_dir = group[n % workers].env["HEADWATER_STREAMS_STATE_DIR"]
        group[n % workers].kill()
        group[n % workers] = worker_factory(capture.cfg.topic_prefix, app_id=app_id, views=VIEWS,
                                            state_dir=state_dir).start()  # fmt: skip
    committed = writer.stop()
    assert committed > 100
    # 120 s: on an overloaded CI leg the fan-out resumed 49 s after the last rebalance (3-5 s here)
    views_reconciled(shop_db, capture, group[0], local_stack.redis_url, timeout=120, others=group[1:])
    for worker in group[1:]:
        views_reconciled(shop_db, capture, worker, local_stack.redis_url, timeout=5)  # any endpoint answers any row


def test_workers_paused_past_their_session_under_load_come_back_and_the_views_equal_the_sql(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig, shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    """kill -STOP, then -CONT, each of two workers in turn while the shop's load runs (inserts, updates, deletes):
    the other takes its partitions; the one that comes back may still write a little (a zombie), then is given
    partitions again (often some it held). Topic, endpoints and Redis end equal to the SQL join, and the table
    topics and every worker's table endpoint to the tables."""
    capture, first = start(shop_db, pg_database, capture_factory, worker_factory)
    group = [first, worker_factory(capture.cfg.topic_prefix, app_id=first.env["HEADWATER_STREAMS_APP_ID"],
                                   views=VIEWS).start()]  # fmt: skip
    writer = shop_writer(rate=60)
    for worker in [*group, *group]:
        time.sleep(4)
        # paused once the group is stable: a pause that lands in a join outlasts no session (CI saw it)
        assert wait_for(lambda: all(w.synced() for w in group), 60), [w.tail() for w in group]
        worker.pause(9)  # the session is 6 s on the local broker
    time.sleep(4)
    assert writer.stop() > 100
    for worker in group:
        views_reconciled(shop_db, capture, worker, local_stack.redis_url, timeout=120)
    reconciled(shop_db, capture, group, timeout=120)
    assert not [w for w in group if w.process is None or w.process.poll() is not None], "a paused worker stopped"
    for worker in group:  # each pause outlasted the session: the group had replaced the worker (aiokafka's words)
        log = worker.log.read_text()
        assert "session expired" in log or "member_id was not recognized" in log, worker.tail()


class Killer:
    """kill -9 a random worker of a group every few seconds and start it again on its own state."""

    def __init__(self, workers: list[Worker], factory: Callable[..., Worker], prefix: str, seed: int) -> None:
        self.workers, self.factory, self.prefix = workers, factory, prefix
        self.rng = random.Random(seed)
        self.kills = 0

    def round(self) -> None:
        n = self.rng.randrange(len(self.workers))
        worker = self.workers[n]
        worker.kill()
        self.kills += 1
        self.workers[n] = self.factory(self.prefix, app_id=worker.env["HEADWATER_STREAMS_APP_ID"], views=VIEWS,
                                       state_dir=worker.env["HEADWATER_STREAMS_STATE_DIR"]).start()  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_transaction_is_never_half_visible_at_a_published_cut(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig, workers: int,
) -> None:  # fmt: skip
    """One transaction moves a customer and six of its orders (rows of several view partitions, so of several
    workers) to the next generation; Redis and the view topic read at any cut show one generation, while
    workers are killed -9 and come back."""
    with shop_db, shop_db.cursor() as cur:
        cur.execute("INSERT INTO customers (email, name, region) VALUES ('cut@x', 'gen-0', 'north') RETURNING id")
        customer = cur.fetchone()[0]
        cur.execute("INSERT INTO orders (customer_id, note) SELECT %s, 'gen-0' FROM generate_series(1, 6) "
                    "RETURNING id", (customer,))  # fmt: skip
        orders = [row[0] for row in cur.fetchall()]
    capture, first = start(shop_db, pg_database, capture_factory, worker_factory)
    prefix = capture.cfg.topic_prefix
    group = [first, *(worker_factory(prefix, app_id=first.env["HEADWATER_STREAMS_APP_ID"], views=VIEWS).start()
                      for _ in range(workers - 1))]  # fmt: skip
    client = redis.Redis.from_url(local_stack.redis_url)
    seen: list[tuple[int, list[list[str]]]] = []
    cuts: set[int] = set()
    stop = threading.Event()

    def sample() -> None:  # read Redis atomically, as the README tells readers to
        while not stop.is_set():
            pipe = client.pipeline(transaction=True)
            pipe.hget(f"{prefix}:orders_enriched", "cut_lsn")
            for order in orders:
                pipe.hget(f"{prefix}:orders_enriched:{order}", "doc")
            cut, *docs = pipe.execute()
            if cut is not None and all(docs):
                seen.append((int(cut), [generations(json.loads(d)) for d in docs]))
                cuts.add(int(cut))

    generation = [0]
    enough = threading.Event()

    def more(until: float) -> bool:  # until the kills are done, then until 150 generations and 11 cuts (120 s)
        few = generation[0] < 150 or len(cuts) <= 10
        return not enough.is_set() or (few and time.monotonic() < until)

    def load() -> None:
        conn = psycopg2.connect(pg_database)
        until = time.monotonic() + 120
        while more(until):  # one transaction: all move to the next generation
            n = generation[0] + 1
            with conn, conn.cursor() as cur:
                cur.execute("UPDATE customers SET name = %s WHERE id = %s", (f"gen-{n}", customer))
                for order in orders:
                    cur.execute("UPDATE orders SET note = %s WHERE id = %s", (f"gen-{n}", order))
            generation[0] = n
            time.sleep(0.03)
        conn.close()

    killer = Killer(group, worker_factory, prefix, seed=workers)
    reader, writer = threading.Thread(target=sample), threading.Thread(target=load)
    reader.start()
    writer.start()
    try:
        while workers > 1 and killer.kills < 4:  # kill -9 and restart while the load runs
            time.sleep(killer.rng.uniform(1.0, 2.5))
            killer.round()
        enough.set()
        writer.join()
        final = [[f"gen-{generation[0]}", f"gen-{generation[0]}"]] * len(orders)
        assert wait_for(lambda: seen and seen[-1][1] == final, 90), (seen[-3:], killer.workers[0].tail())
    finally:
        enough.set()
        stop.set()
        reader.join()
        writer.join()
    assert len({tuple(map(tuple, g)) for _, g in seen}) > 5, "too few generations seen to mean anything"
    mixed = [(cut, g) for cut, g in seen if len({x for pair in g for x in pair}) != 1]
    assert not mixed, mixed[:5]
    topic_read_at_every_cut_shows_one_generation(capture, orders)


def topic_read_at_every_cut_shows_one_generation(capture: Capture, orders: list[int]) -> None:
    """The view topic read to each published cut's ends: every order at one generation; no row ever goes back
    to an older commit LSN."""
    prefix = capture.cfg.topic_prefix
    records = read_topic(capture.cfg.bootstrap, f"{prefix}.views.orders_enriched")
    decode = Registry(capture.cfg.registry_url)
    cuts = [decode_cut(r.value) for r in read_topic(capture.cfg.bootstrap, f"{prefix}.views.cuts") if r.value]
    assert len(cuts) > 10
    docs = {(r.partition, r.offset): decode(r.value) for r in records if r.value is not None}
    newest: dict[bytes, int] = {}
    for r in records:  # per key, in offset order (one key is in one partition)
        lsn = int(dict(r.headers)["hw.lsn"])
        assert lsn >= newest.get(r.key, -1), (r.partition, r.offset, lsn, newest.get(r.key))
        newest[r.key] = lsn
    for cut in cuts:
        ends = {e["partition"]: e["offset"] for e in cut["ends"]}
        latest: dict[int, Any] = {}
        for r in records:
            doc = docs.get((r.partition, r.offset))
            if r.offset < ends.get(r.partition, 0) and doc is not None and doc["id"] in orders:
                assert doc["hw_commit_lsn"] <= cut["commit_lsn"]
                latest[doc["id"]] = generations(to_json(doc))
        gens = {x for pair in latest.values() for x in pair}
        assert len(latest) == len(orders) and len(gens) == 1, (cut, latest)


def generations(doc: dict[str, Any]) -> list[str]:
    return [doc["note"], doc["customer"]["name"]]


def test_redis_away_the_view_topic_flows_and_redis_catches_up_when_it_returns(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    tmp_path: Any, shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    capture, worker = start(shop_db, pg_database, capture_factory, worker_factory, redis_url=url)
    writer = shop_writer(rate=100)
    time.sleep(2)
    writer.stop()
    views_reconciled(shop_db, capture, worker, None)  # the topic and the endpoint, without Redis
    assert "is unavailable" in worker.log.read_text()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        views_reconciled(shop_db, capture, worker, url)
        cut = redis_view_docs(url, capture.cfg.topic_prefix, "orders_enriched")[1]
        with shop_db.cursor() as cur:
            cur.execute("SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots WHERE slot_name = %s",
                        (capture.cfg.slot,))  # fmt: skip
            confirmed = int(cur.fetchone()[0])
        shop_db.commit()
        assert cut is not None and cut > 0 and cut <= confirmed
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


def test_a_first_fill_under_load_goes_in_pieces_before_any_cut_and_a_redis_that_lost_its_data_is_filled_again(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    tmp_path: Any, shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    """A view Redis holds no cut of is written ``redis_fill_rows`` rows per script (Redis answers others between
    them): rows appear before the view's hash names a cut; under load (entries past the cut carried in order)
    and after a FLUSHALL, Redis ends equal to the SQL join. A row per script: at 10, the 580-710 records of a fill
    took under 0.1 s, and a sampler on a machine as busy as CI's could miss them all (3 CI legs)."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    capture, worker = start(shop_db, pg_database, capture_factory, worker_factory, redis_url=url, redis_fill_rows=1)
    loosen(pg_database)
    writer = shop_writer(rate=100)
    time.sleep(3)  # the view topic grows while Redis is away: its first fill is of some thousand records
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)  # fmt: skip
    client = redis.Redis.from_url(url)
    meta = f"{capture.cfg.topic_prefix}:orders_enriched"
    try:
        assert wait_for(lambda: ping(client), 30)
        for fill in range(2):  # the first fill, then one after Redis lost its data
            samples = samples_until_cut(client, meta)
            fills = [line for line in worker.log.read_text().splitlines() if "Redis mirror: filling" in line]
            assert any(rows > 10 for rows in samples), (samples[-20:], fills)  # rows of many pieces, no cut yet
            unruly(pg_database, 20, seed=fill)
            client.flushall()
        writer.stop()
        views_reconciled(shop_db, capture, worker, url)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    assert "Redis holds other offsets" in worker.log.read_text()


def ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def samples_until_cut(client: redis.Redis, meta: str, timeout: float = 90) -> list[int]:
    """The view's rows in Redis (keys but the view's hash and the mirror's lists), sampled atomically until the
    view's hash names a cut."""
    samples: list[int] = []
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        pipe = client.pipeline(transaction=True)
        pipe.hexists(meta, "cut_lsn")
        pipe.dbsize()
        pipe.exists(meta)
        cut, size, hashes = pipe.execute()
        if cut:
            return samples
        samples.append(max(size - hashes - 2, 0))
    raise AssertionError(f"no cut in Redis within {timeout} s: {samples[-20:]}")


def test_an_invalid_view_spec_stops_the_worker_at_start_naming_the_line(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
) -> None:  # fmt: skip
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    bad = VIEWS.replace("customers on customer_id", "customers on client_id")
    worker = worker_factory(capture.cfg.topic_prefix, views=bad)
    with pytest.raises(AssertionError, match="worker exited with 2") as failed:
        worker.start()
    assert "line 4: view orders_enriched: customer: public.orders has no column 'client_id'" in str(failed.value)
    assert "Traceback" not in worker.log.read_text()


def test_a_worker_started_before_capture_waits_for_its_views_tables_then_keeps_the_views(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig, unique_name: str,
) -> None:  # fmt: skip
    """Workers may start first with views too: one whose views join tables nothing captured yet waits (saying
    which) instead of stopping, and keeps the views once capture has registered the tables."""
    worker = worker_factory(unique_name, views=VIEWS, discover_every=1).launch()  # the tests' captures' prefix
    waiting = "views orders_enriched wait for public.customers, public.order_items, public.orders, public.products"
    assert wait_for(lambda: waiting in worker.log.read_text(errors="replace"), 60), worker.tail()
    time.sleep(3)
    assert worker.process is not None and worker.process.poll() is None, worker.tail()
    capture = capture_factory(pg_database).start()
    worker.wait_ready(120)
    capture.wait_caught_up(pg_database)
    with shop_db, shop_db.cursor() as cur:
        cur.execute("UPDATE customers SET name = name || ' (late)' WHERE id % 3 = 0")
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    assert "the views' tables are captured now" in worker.log.read_text(errors="replace")


def test_without_discovery_a_view_over_a_table_not_captured_stops_the_worker_saying_what_to_check(
    shop_db: Any, pg_database: str, worker_factory: Callable[..., Worker], unique_name: str,
) -> None:  # fmt: skip
    worker = worker_factory(unique_name, views=VIEWS, discover_every=0)
    with pytest.raises(AssertionError, match="worker exited with 2") as failed:
        worker.start()
    assert "base table public.orders is not captured with a key (captured: none)" in str(failed.value)
    assert "matched by [capture] include" in worker.log.read_text()


def test_a_view_on_tables_not_kept_before_is_built_from_the_start_of_the_raw_topic(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig, shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    first = '[views.orders_only]\nbase = "orders"\njoins = ["customer: customers on customer_id"]\n'
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    worker = worker_factory(capture.cfg.topic_prefix, views=first).start()
    app_id = worker.env["HEADWATER_STREAMS_APP_ID"]
    writer = shop_writer(rate=100)
    time.sleep(2)
    writer.stop()
    worker.kill(signal.SIGTERM)
    state_dir = worker.env["HEADWATER_STREAMS_STATE_DIR"]
    worker = worker_factory(capture.cfg.topic_prefix, app_id=app_id, views=first + "\n" + VIEWS,
                            state_dir=state_dir).start()  # fmt: skip
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)  # items and products came from offset 0
    assert "whose rows were not kept: replaying" in worker.log.read_text()


def forget_topics(capture: Capture, which: str) -> None:
    """Every topic of the pipeline gone (what a broker that lost its data leaves, such as the local stack's
    in-memory one after a restart), the raw topic only (deleted by hand: capture then starts over with a new
    slot and a new snapshot), or the others ("tables": what the fan-out asks for then)."""
    admin = AdminClient({"bootstrap.servers": capture.cfg.bootstrap})
    prefix = capture.cfg.topic_prefix + "."
    topics = [t for t in admin.list_topics(timeout=10).topics if t.startswith(prefix)]
    if which != "every":  # the raw topic only, or every other one (after it)
        topics = [t for t in topics if (t == capture.cfg.changes_topic) == (which == "raw")]
    for future in admin.delete_topics(topics).values():
        future.result(timeout=30)
    assert wait_for(lambda: not set(topics) & set(admin.list_topics(timeout=10).topics), 30)


@pytest.mark.parametrize("which", ["every", "raw"])
def test_a_worker_restarted_on_topics_made_again_rebuilds_its_state_from_them(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig, which: str,
) -> None:  # fmt: skip
    capture, worker = start(shop_db, pg_database, capture_factory, worker_factory)
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    app_id, state_dir = worker.env["HEADWATER_STREAMS_APP_ID"], worker.env["HEADWATER_STREAMS_STATE_DIR"]
    worker.kill(signal.SIGTERM)
    capture.stop()
    forget_topics(capture, which)
    conn = psycopg2.connect(capture.cfg.dsn.reveal())
    try:
        slot.drop(conn, capture.cfg.slot)
    finally:
        conn.close()
    shutil.rmtree(capture.cfg.state_dir)
    with shop_db, shop_db.cursor() as cur:  # while nothing runs: some orders go, more come than there were
        cur.execute("SELECT id FROM orders ORDER BY id LIMIT 20")
        gone = [row[0] for row in cur.fetchall()]
        cur.execute("DELETE FROM order_items WHERE order_id = ANY(%s)", (gone,))
        cur.execute("DELETE FROM orders WHERE id = ANY(%s)", (gone,))
        cur.execute("INSERT INTO orders (customer_id, note) SELECT (SELECT array_agg(id) FROM customers)[1 + n % 10], "
                    "'after the broker forgot' FROM generate_series(1, 3000) n")  # fmt: skip
        cur.execute("UPDATE customers SET name = name || ' again' WHERE id % 7 = 0")
    capture = capture_factory(pg_database).start()  # the same slot name, prefix and raw topic: new
    capture.wait_caught_up(pg_database)
    worker = worker_factory(capture.cfg.topic_prefix, app_id=app_id, views=VIEWS, state_dir=state_dir)
    logs = [worker.log]
    if which == "raw":  # table topics written from the old raw topic: the fan-out stops, saying what to delete
        with contextlib.suppress(AssertionError):  # it stops before it is ready, or just after
            worker.start()
        assert worker.process is not None and worker.process.wait(timeout=60) != 0, worker.tail()
        assert "is not the raw topic the fan-out's checkpoint and the table topics were written from" in \
            worker.log.read_text(), worker.tail()  # fmt: skip
        forget_topics(capture, "tables")
        worker = worker_factory(capture.cfg.topic_prefix, app_id=app_id, views=VIEWS, state_dir=state_dir)
        logs.append(worker.log)
    worker.start()
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    assert all(worker.get(f"/tables/orders/{order}").status_code == 404 for order in gone)
    count, problems = compare_endpoint(shop_db, "orders", ["id"], worker.url, "orders")
    assert count > 3000 and not problems, problems[:10]
    text = "".join(log.read_text() for log in logs)
    assert "views are rebuilt from the new topic's start" in text and "Redis again" in text, worker.tail()


def composite_workload(dsn: str, transactions: int, seed: int) -> None:
    """Warehouses (keyed by region and code), notes of order items (keyed by item and number) and the orders'
    warehouse columns, inserted, changed and deleted at random."""
    conn = psycopg2.connect(dsn)
    rng = random.Random(seed)
    for n in range(transactions):
        with conn, conn.cursor() as cur:
            region, code = rng.choice(["north", "south"]), rng.choice(["a", "b", "c"])
            if rng.random() < 0.3:
                cur.execute("INSERT INTO warehouses VALUES (%s, %s, %s) ON CONFLICT (region, code) DO UPDATE SET "
                            "name = excluded.name", (region, code, f"w{n}"))  # fmt: skip
            elif rng.random() < 0.1:
                cur.execute("DELETE FROM warehouses WHERE region = %s AND code = %s", (region, code))
            cur.execute("UPDATE orders SET region = %s, wh_code = %s WHERE id = (SELECT id FROM orders ORDER BY "
                        "random() LIMIT 1)", (rng.choice([region, None]), code))  # fmt: skip
            cur.execute("SELECT order_id, line_no FROM order_items ORDER BY random() LIMIT 1")
            item = cur.fetchone()
            if item is not None and rng.random() < 0.8:
                cur.execute("INSERT INTO item_notes VALUES (%s, %s, %s, %s) ON CONFLICT (order_id, line_no, n) DO "
                            "UPDATE SET body = excluded.body", (*item, rng.randint(1, 3), f"note {n}"))  # fmt: skip
            if item is not None and rng.random() < 0.2:
                cur.execute("DELETE FROM item_notes WHERE order_id = %s AND line_no = %s", item)
    conn.close()


def test_views_joined_on_composite_keys_equal_the_sql_join_with_two_workers(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig, shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    with shop_db, shop_db.cursor() as cur:
        cur.execute("CREATE TABLE warehouses (region text, code text, name text NOT NULL, PRIMARY KEY (region, code))")
        cur.execute("CREATE TABLE item_notes (order_id bigint, line_no integer, n integer, body text, "
                    "PRIMARY KEY (order_id, line_no, n))")  # fmt: skip
        cur.execute("ALTER TABLE orders ADD COLUMN region text, ADD COLUMN wh_code text")
    composite_workload(pg_database, 50, seed=1)
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    first = worker_factory(capture.cfg.topic_prefix, views=NOTED).start()
    second = worker_factory(capture.cfg.topic_prefix, app_id=first.env["HEADWATER_STREAMS_APP_ID"], views=NOTED).start()
    writer = shop_writer(rate=100)
    composite_workload(pg_database, 400, seed=2)
    assert wait_for(lambda: writer.work.committed > 50, 30, every=0.1), "the shop's load ran alongside"
    writer.stop()
    shapes = {**SHAPES, "public.warehouses": TableShape("public.warehouses", (), ("region", "code")),
              "public.item_notes": TableShape("public.item_notes", (), ("order_id", "line_no", "n"))}  # fmt: skip
    sql = parse_views(tomllib.loads(NOTED), NOTED)[0].sql(shapes)
    for worker in (first, second):  # either endpoint answers every row (routed to its partition's worker)
        views_reconciled(shop_db, capture, worker, local_stack.redis_url, view="items_noted", sql=sql)
    expected = view_docs_sql(shop_db, sql)
    assert sum(len(d["notes"]) for d in expected.values()) > 20  # composite collects were seen
    assert sum(1 for d in expected.values() if d["order"] and d["order"]["warehouse"]) > 10  # and lookups


def test_a_numeric_column_given_a_new_scale_reaches_the_views_and_a_restart_keeps_them(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    local_stack: StackConfig,
) -> None:  # fmt: skip
    """``ALTER ... TYPE numeric(14,3)`` under a view that shows the column: the view follows the wider type (its rows
    written before keep their schema), and a worker started again composes the view with it from the start."""
    capture, worker = start(shop_db, pg_database, capture_factory, worker_factory)
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    with shop_db, shop_db.cursor() as cur:
        cur.execute("ALTER TABLE products ALTER COLUMN price TYPE numeric(14, 3)")
    with shop_db, shop_db.cursor() as cur:
        cur.execute("UPDATE products SET price = price + 0.005 WHERE id IN (SELECT product_id FROM order_items "
                    "ORDER BY order_id LIMIT 3)")  # fmt: skip
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    assert "now holds" in worker.log.read_text()
    app_id, state_dir = worker.env["HEADWATER_STREAMS_APP_ID"], worker.env["HEADWATER_STREAMS_STATE_DIR"]
    worker.kill(signal.SIGTERM)
    with shop_db, shop_db.cursor() as cur:
        cur.execute("UPDATE products SET price = price + 0.001 WHERE id IN (SELECT product_id FROM order_items "
                    "ORDER BY order_id DESC LIMIT 3)")  # fmt: skip
    worker = worker_factory(capture.cfg.topic_prefix, app_id=app_id, views=VIEWS, state_dir=state_dir).start()
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
