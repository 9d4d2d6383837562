"""The streams engine without its host: no Faust app, no I/O at import, the real stack behind it."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import redis
from confluent_kafka import Producer

from headwater import shop
from headwater.reconcile import compare, compare_docs, latest_view_docs, redis_view_docs, view_docs_sql
from streams import frontier
from streams.config import StreamsConfig, load_streams_config
from streams.engine import Engine, open_catalog
from streams.fanout import header_lsn
from streams.rows import unpack
from streams.store import TableStore
from streams.viewstore import ViewStore
from streams.writer import TableWriter
from tables.config import StackConfig
from tables.errors import FatalError
from tables.kafka import bounds_of, read_topic
from tables.registry import Registry
from tables.topics import debezium_topic
from tables.views import decode_cut, parse_views
from tables.wire import body
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.streams import REPO, streams_env
from tests.streams.test_views import SQL
from tests.streams.test_workers import wait_for

ENGINE = ["streams", "streams.engine", "streams.fanrun", "streams.fanout", "streams.joins", "streams.materializer",
          "streams.cuts", "streams.cursor", "streams.feed", "streams.tablefeed", "streams.writer", "streams.mirror",
          "streams.store", "streams.viewstore", "streams.catalog", "streams.clients", "streams.frontier",
          "streams.leader", "streams.placement", "streams.docbytes", "streams.sources"]  # fmt: skip
NO_IO = """
import socket, sys
def refuse(*args, **kwargs):
    raise AssertionError(f"I/O at import: {args}")
socket.socket.connect = socket.socket.connect_ex = socket.create_connection = refuse
import builtins
builtins.open = refuse  # imports read their files with io.open_code, not open
for name in sys.argv[1:]:
    __import__(name)
host = sorted(m for m in sys.modules if m.split(".")[0] in ("faust", "mode", "aiokafka", "aiohttp"))
print("host modules:", host)
"""


@pytest.mark.unit
def test_the_engine_imports_without_faust_and_without_io() -> None:
    done = subprocess.run([sys.executable, "-c", NO_IO, *ENGINE], capture_output=True, text=True, cwd=REPO,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "host modules: []", done.stdout


def engine_config(local_stack: StackConfig, prefix: str, state: Path, **settings: str) -> StreamsConfig:
    env = streams_env(local_stack, prefix, f"{prefix}-engine", state)
    return load_streams_config(env | {f"HEADWATER_STREAMS_{k.upper()}": v for k, v in settings.items()})


def store_rows(engine: Engine, table: str) -> dict[bytes, dict[str, Any]]:
    """A table's rows as the engine's table store holds them (key body -> decoded row)."""
    found = engine.catalog.find(table)
    assert found is not None, table
    rows = {}
    for partition in range(engine.cfg.partitions):
        for key in engine.store.keys(found.topic, partition):
            packed = engine.store.get(found.topic, partition, key)
            if packed is None:  # the running engine deleted it since the listing: the next look sees the rest
                continue
            rows[body(key)] = engine.schemas.decode(unpack(packed)[2])
    return rows


def problems(conn: Any, engine: Engine, tables: bool = True) -> list[str]:
    """PostgreSQL against the table store (unless not ``tables``), the view topic and Redis."""
    found = [p for table, key in shop.KEYS.items() if tables
             for p in compare(conn, table, key, store_rows(engine, table))[1]]  # fmt: skip
    expected = view_docs_sql(conn, SQL)
    topic = engine.cfg.view_topic("orders_enriched")
    found += compare_docs(expected, latest_view_docs(engine.cfg.bootstrap, topic, engine.schemas), "topic")
    redis_docs = redis_view_docs(engine.cfg.redis_url, engine.cfg.topic_prefix, "orders_enriched")[0]
    return found + compare_docs(expected, redis_docs, "redis")


def not_here(engine: Engine) -> None:
    """A worker that does not hold the raw partition shows no cut and watches none: an hour on, no age."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    engine.watch_cut(time.monotonic() + 3600)
    text = generate_latest(engine.metrics.registry).decode()
    shown = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert not shown & {"headwater_streams_view_cut_lsn", "headwater_streams_view_cut_age_seconds"}, shown
    assert engine.metrics.cut.age(time.monotonic() + 3600) == 0


def settled(conn: Any, engine: Engine, timeout: float = 90, tables: bool = True) -> None:
    last: list[str] = []

    def check() -> bool:
        nonlocal last
        last = problems(conn, engine, tables)
        return not last

    assert wait_for(check, timeout, every=1.0), "\n".join(last[:20])


def shop_engine(pg_database: str, capture_factory: Callable[..., Capture], local_stack: StackConfig,
                tmp_path: Path, **settings: str) -> tuple[Engine, list[tuple[str, FatalError]]]:  # fmt: skip
    """Capture of the test's shop, and an engine (no host) keeping the shop's view: the engine and its fatal errors."""
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    return another_engine(local_stack, capture.cfg.topic_prefix, tmp_path, **settings)


def another_engine(local_stack: StackConfig, prefix: str, root: Path,
                   **settings: str) -> tuple[Engine, list[tuple[str, FatalError]]]:  # fmt: skip
    """An engine (a worker of the group, no host) with state of its own under ``root``, and its fatal errors."""
    cfg = engine_config(local_stack, prefix, root / "state", **settings)
    schemas, writer = Registry(cfg.registry_url), TableWriter(cfg)
    catalog = open_catalog(cfg, parse_views(tomllib.loads(shop.VIEWS_TOML), shop.VIEWS_TOML), schemas, writer)
    fatal: list[tuple[str, FatalError]] = []
    engine = Engine(cfg, schemas, writer, catalog, TableStore(root / "tables"), ViewStore(root / "views"),
                    lambda part, exc: fatal.append((part, exc)))  # fmt: skip
    return engine, fatal


@pytest.mark.slow
def test_the_engine_runs_without_a_host_tables_views_and_redis_follow_postgres(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], local_stack: StackConfig, tmp_path: Path,
    shop_writer: Callable[..., ShopWriter]
) -> None:  # fmt: skip
    engine, fatal = shop_engine(pg_database, capture_factory, local_stack, tmp_path)
    cfg, catalog = engine.cfg, engine.catalog
    before = set(threading.enumerate())
    topics = [*(t.topic for t in catalog.tables), *(v.topic for v in catalog.views.values())]
    parts = {(topic, p) for topic in topics for p in range(cfg.partitions)}
    try:
        engine.assigned(parts | {engine.raw})
        settled(shop_db, engine)
        assert engine.mirror is not None  # the raw partition's owner mirrors the views
        assert engine.mirror.staged >= len(view_docs_sql(shop_db, SQL))  # every row went through staging
        applied = engine.metrics.registry.get_sample_value("headwater_streams_redis_apply_seconds_count")
        assert applied is not None and applied >= 1, "no cut's application was timed"
        work = shop_writer(rate=200)
        wait_for(lambda: work.work.committed >= 400, 60)
        assert work.stop() >= 400
        settled(shop_db, engine)
        engine.revoked()  # another worker takes everything, then gives it back: the state resumes
        not_here(engine)
        engine.assigned({(t, p) for t, p in parts if t not in engine.view_topics})  # the tables only: the views
        not_here(engine)  # and the raw partition are held elsewhere
        engine.assigned(parts | {engine.raw})
        shop_writer(rate=200).stop()
        settled(shop_db, engine)
    finally:
        engine.close()
    assert not fatal
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, f"threads the engine did not stop: {left}"
    client = redis.Redis.from_url(cfg.redis_url)
    assert not list(client.scan_iter(match=f"{cfg.topic_prefix}:*#staged:*")), "staging lists left behind"
    client.close()


@pytest.mark.slow
def test_a_revocation_returns_only_once_kafka_has_every_view_row_written(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], local_stack: StackConfig, tmp_path: Path,
    shop_writer: Callable[..., ShopWriter]
) -> None:  # fmt: skip
    """The revoked-partition window: once ``revoked`` returns, nothing of this worker's is on its way to a view
    topic (the next holder reads the partition back complete), whatever was being published at that moment."""
    engine, fatal = shop_engine(pg_database, capture_factory, local_stack, tmp_path)
    cfg = engine.cfg
    topic = cfg.view_topic("orders_enriched")
    parts = {(topic, p) for p in range(cfg.partitions)} | {engine.raw}
    assert engine.views is not None
    load = shop_writer(rate=300)
    rng = random.Random(19)
    written = []
    try:
        engine.assigned(parts)
        for turn in range(10):  # give everything up while rows are being published, then take it back
            before = engine.views.publisher.published
            # a publication began (on a loaded machine the first after an assignment can take seconds to come)
            assert wait_for(lambda n=before: engine.views is not None and engine.views.publisher.published > n, 60), (
                f"nothing published within 60 s of assignment {turn}")
            time.sleep(rng.uniform(0.0, 0.3))
            assert engine.viewing is not None
            engine.viewing.stop()  # the views' share of a revocation, which comes first in ``revoked``
            written.append(engine.views.publisher.published - before)
            assert len(engine.views.cuts.producer) == 0, "view rows still on their way after the revocation"
            cuts = engine.views.cuts  # the points' ends, and of a publication the revocation stopped part way
            ends = {p: max(end, cuts.current.ends.get((topic, p), 0))
                    for p, end in cuts.ends["orders_enriched"].items()}  # fmt: skip
            ends_of = bounds_of({"bootstrap.servers": cfg.bootstrap}, [(topic, p) for p in ends])
            assert {p: ends_of[(topic, p)][1] for p in ends} == ends
            engine.revoked()
            engine.assigned(parts)
        load.stop()
        settled(shop_db, engine, tables=False)
    finally:
        engine.close()
    assert not fatal
    assert sum(written) > 10, written  # rows were being published around the revocations


@pytest.mark.slow
def test_partitions_given_back_after_another_worker_held_them_show_that_workers_rows_and_their_deletes(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], local_stack: StackConfig, tmp_path: Path,
) -> None:  # fmt: skip
    """A worker paused past its session falls out of the group; another holds its view partitions and publishes
    new orders; when the first comes back and is given the same partitions again, it must know those rows:
    deleted afterwards, they get their tombstones (no phantom on the view topic or in Redis)."""
    first, fatal = shop_engine(pg_database, capture_factory, local_stack, tmp_path / "a")
    second, fatal_b = another_engine(local_stack, first.cfg.topic_prefix, tmp_path / "b")
    cfg = first.cfg
    views = {(cfg.view_topic("orders_enriched"), p) for p in range(cfg.partitions)}
    try:
        first.assigned(views | {first.raw})
        settled(shop_db, first, tables=False)
        assert first.viewing is not None
        first.viewing.stop()  # paused: the group gives its view partitions to the other worker
        second.assigned(views)
        with shop_db, shop_db.cursor() as cur:
            cur.execute("INSERT INTO orders (customer_id, note) SELECT id, 'while away' FROM customers ORDER BY id "
                        "LIMIT 40 RETURNING id")  # fmt: skip
            orders = [row[0] for row in cur.fetchall()]
            cur.execute("INSERT INTO order_items SELECT o, 1, (SELECT min(id) FROM products), 2, 3.5 "
                        "FROM unnest(%s::bigint[]) o", (orders,))  # fmt: skip
        settled(shop_db, first, tables=False)  # published by the other worker
        second.revoked()
        with shop_db, shop_db.cursor() as cur:  # deleted while the partitions move
            cur.execute("DELETE FROM orders WHERE id = ANY(%s)", (orders,))
        for n in range(300):  # more points than a feed reads back: the first one it publishes at comes after all this
            with shop_db, shop_db.cursor() as cur:
                cur.execute("UPDATE customers SET name = %s WHERE id = (SELECT min(id) FROM customers)", (f"n{n}",))
            time.sleep(0.005)
        time.sleep(2)
        first.revoked()
        first.assigned(views | {first.raw})  # back, and given the same partitions
        settled(shop_db, first, tables=False)
        assert first.metrics.registry.get_sample_value("headwater_streams_view_strays_total") >= len(orders)
    finally:
        second.close()
        first.close()
    assert not fatal and not fatal_b


@pytest.mark.slow
def test_a_worker_back_after_the_point_in_flight_left_its_window_publishes_without_the_pace_s_patience(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], local_stack: StackConfig, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Seen at 720k after a kill -9: while a worker was away a point went out that its partitions never published;
    the raw owner then announced only ends (one point in flight), more than a feed reads back, so the worker, back,
    never saw that point, and the next waited the pace's patience (4 x the survivor's 158 s publication: ten
    minutes). With a patience of ten minutes here, the view must still follow PostgreSQL within a minute or so."""
    monkeypatch.setattr(frontier, "PATIENCE_FLOOR", 600.0)
    first, fatal = shop_engine(pg_database, capture_factory, local_stack, tmp_path / "a")
    second, fatal_b = another_engine(local_stack, first.cfg.topic_prefix, tmp_path / "b")
    topic = first.cfg.view_topic("orders_enriched")
    try:
        first.assigned({(topic, 0), (topic, 1), first.raw})
        second.assigned({(topic, 2), (topic, 3)})
        settled(shop_db, first, tables=False)
        assert second.viewing is not None
        second.viewing.stop()  # away: its partitions publish nothing
        for n in range(300):  # a point, which the first publishes alone, then more ends than a feed reads back
            with shop_db, shop_db.cursor() as cur:
                cur.execute("UPDATE customers SET name = %s WHERE id IN (SELECT customer_id FROM orders LIMIT 20)",
                            (f"n{n}",))
            time.sleep(0.005)
        time.sleep(2)
        second.revoked()
        second.assigned({(topic, 2), (topic, 3)})  # back
        settled(shop_db, first, tables=False)
    finally:
        second.close()
        first.close()
    assert not fatal and not fatal_b


@pytest.mark.slow
@pytest.mark.parametrize("then", ["more writes", "quiet", "quiet, after a rebalance"])
def test_an_old_row_another_worker_writes_among_this_workers_rows_is_never_in_a_cut_and_is_written_again(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], local_stack: StackConfig, tmp_path: Path,
    then: str,
) -> None:  # fmt: skip
    """A zombie (a worker paused past its session that has not noticed yet) writes an old version of a row after
    the holder's newer one: here a deleted order's last row, sent again after its tombstone. The holder finds it
    by the offsets of its next rows in that partition, or, with nothing more to write, by the partition's end past
    its last row (also when its views were stopped and started again since their last change: a rebalance); it
    makes no cut over it, and writes the tombstone again after it, at the consistent point its state is at."""
    engine, fatal = shop_engine(pg_database, capture_factory, local_stack, tmp_path)
    assert engine.views is not None
    engine.views.look_every = 3600.0 if then == "more writes" else 1.0  # more writes: found by their offsets
    cfg = engine.cfg
    topic = cfg.view_topic("orders_enriched")
    try:
        everything = {(topic, p) for p in range(cfg.partitions)} | {engine.raw}
        engine.assigned(everything)
        with shop_db, shop_db.cursor() as cur:
            cur.execute("INSERT INTO orders (customer_id, note) SELECT min(id), 'doomed' FROM customers RETURNING id")
            doomed = cur.fetchone()[0]
        settled(shop_db, engine, tables=False)
        with shop_db, shop_db.cursor() as cur:
            cur.execute("DELETE FROM orders WHERE id = %s", (doomed,))
        settled(shop_db, engine, tables=False)
        mine = [r for r in read_topic(cfg.bootstrap, topic) if engine.schemas.decode(r.key)["id"] == doomed]
        assert [r.value is None for r in mine] == [False, True]
        if then == "quiet, after a rebalance":
            engine.revoked()
            engine.assigned(everything)
        zombie = Producer({"bootstrap.servers": cfg.bootstrap})
        zombie.produce(topic, mine[0].value, mine[0].key, partition=mine[0].partition, headers=list(mine[0].headers))
        assert zombie.flush(10) == 0
        if then == "more writes":
            with shop_db, shop_db.cursor() as cur:  # rows in every partition: the holder's next ones land after it
                cur.execute("UPDATE orders SET note = 'next' WHERE id IN (SELECT id FROM orders ORDER BY id LIMIT 40)")
        settled(shop_db, engine, tables=False)
        assert engine.metrics.registry.get_sample_value("headwater_streams_view_strays_total") == 1
    finally:
        engine.close()
    assert not fatal
    records = [r for r in read_topic(cfg.bootstrap, topic) if r.partition == mine[0].partition]
    at = max(r.offset for r in records if r.key == mine[0].key and r.value is not None)  # the zombie's row
    over = 0
    for cut in [decode_cut(r.value) for r in read_topic(cfg.bootstrap, cfg.cuts_topic) if r.value]:
        end = next(e["offset"] for e in cut["ends"] if e["partition"] == mine[0].partition)
        shown = [r for r in records if r.key == mine[0].key and r.offset < end]
        assert end <= at or shown[-1].value is None, f"cut {cut['commit_lsn']} shows the zombie's row"
        over += end > at
    assert over or then != "more writes", "no cut past the zombie's row"
    last = [r for r in records if r.key == mine[0].key][-1]
    assert last.value is None and last.offset > at, "the tombstone, written again after the zombie's row"
    assert header_lsn(last.headers) >= header_lsn(mine[1].headers), "written again at an older point than its delete"


def records_of(bootstrap: str, topic: str, key: bytes | None) -> list[Any]:
    """A key's records on ``topic``, in offset order."""
    return [r for r in read_topic(bootstrap, topic) if r.key == key]


def zombie_sends_an_old_order(conn: Any, engine: Engine, topic: str, *, delete: bool = True) -> list[Any]:
    """An order inserted, updated and deleted through ``engine``; then a zombie (another producer) sends the
    order's update again after its tombstone: the order's records on ``topic`` before the zombie's (on a
    Debezium-format topic the delete event comes before the tombstone). Without ``delete`` the order is only
    inserted and updated, and the zombie sends its insert again after the update."""
    with conn, conn.cursor() as cur:
        cur.execute("INSERT INTO orders (customer_id, note) SELECT min(id), 'doomed' FROM customers RETURNING id")
        doomed = cur.fetchone()[0]
        cur.execute("UPDATE orders SET note = 'changed' WHERE id = %s", (doomed,))
    settled(conn, engine)
    if delete:
        with conn, conn.cursor() as cur:
            cur.execute("DELETE FROM orders WHERE id = %s", (doomed,))
        settled(conn, engine)
    mine = [r for r in read_topic(engine.cfg.bootstrap, topic) if engine.schemas.decode(r.key)["id"] == doomed]
    kinds = [r.value is None for r in mine]
    assert kinds in ([False, False, True], [False, False, False, True]) if delete else kinds == [False, False]
    old = mine[1] if delete else mine[0]
    zombie = Producer({"bootstrap.servers": engine.cfg.bootstrap})
    zombie.produce(topic, old.value, old.key, partition=old.partition, headers=list(old.headers))
    assert zombie.flush(10) == 0
    return mine


@pytest.mark.slow
@pytest.mark.parametrize("then", ["more writes", "quiet"])
def test_an_old_table_record_another_worker_writes_among_the_fan_outs_is_written_over_with_the_newest(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], local_stack: StackConfig, tmp_path: Path,
    then: str,
) -> None:  # fmt: skip
    """A zombie that owned the raw partition sends an order's old table-topic record (its update) after the fan-out
    wrote the order's delete: the fan-out finds it by the offsets of its next records in that partition, or, with
    nothing more to write, by the partition's end past its last record, and writes the order's newest record, its
    tombstone, again. The table store and the topic end without the order."""
    engine, fatal = shop_engine(pg_database, capture_factory, local_stack, tmp_path)
    engine.fanout.look_every = 1.0
    cfg = engine.cfg
    orders = engine.catalog.find("orders")
    assert orders is not None
    parts = {(t.topic, p) for t in engine.catalog.tables for p in range(cfg.partitions)}
    views = {(cfg.view_topic("orders_enriched"), p) for p in range(cfg.partitions)}
    try:
        engine.assigned(parts | views | {engine.raw})
        mine = zombie_sends_an_old_order(shop_db, engine, orders.topic)
        if then == "more writes":
            with shop_db, shop_db.cursor() as cur:  # records in every partition: the fan-out's next ones land after
                cur.execute("UPDATE orders SET note = 'next' WHERE id IN (SELECT id FROM orders ORDER BY id LIMIT 40)")
        strays = engine.metrics.registry.get_sample_value
        assert wait_for(lambda: strays("headwater_streams_fanout_strays_total") == 1, 60), "the zombie's record unseen"
        settled(shop_db, engine)
    finally:
        engine.close()
    assert not fatal
    last = records_of(cfg.bootstrap, orders.topic, mine[0].key)[-1]
    assert last.value is None and last.offset > mine[-1].offset + 1, "the tombstone, written after the zombie's row"


@pytest.mark.slow
@pytest.mark.parametrize("newest", ["a tombstone", "an update"])
def test_an_old_debezium_record_another_worker_writes_is_written_over_with_the_newest(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], local_stack: StackConfig, tmp_path: Path,
    newest: str,
) -> None:  # fmt: skip
    """The same on a Debezium-format topic (transactions on): a zombie sends an order's old event after the
    fan-out wrote the order's newest there (its delete event and tombstone, or its update event); the fan-out
    finds it at the partition's end and writes the order's newest record again, built from the raw topic as it
    was first built: the same headers, and for an event the same payload and transaction block."""
    database = psycopg2.extensions.parse_dsn(pg_database)["dbname"]
    engine, fatal = shop_engine(pg_database, capture_factory, local_stack, tmp_path, debezium="true",
                                debezium_database=database, debezium_transactions="true")  # fmt: skip
    engine.fanout.look_every = 1.0
    cfg = engine.cfg
    topic = debezium_topic(cfg.dbz_prefix, "public", "orders")
    parts = {(t.topic, p) for t in engine.catalog.tables for p in range(cfg.partitions)}
    views = {(cfg.view_topic("orders_enriched"), p) for p in range(cfg.partitions)}

    try:
        engine.assigned(parts | views | {engine.raw})
        mine = zombie_sends_an_old_order(shop_db, engine, topic, delete=newest == "a tombstone")
        strays = engine.metrics.registry.get_sample_value
        assert wait_for(lambda: strays("headwater_streams_fanout_strays_total") == 1, 60), "the zombie's record unseen"
        assert wait_for(lambda: len(records_of(cfg.bootstrap, topic, mine[0].key)) > len(mine) + 1, 60)
    finally:
        engine.close()
    assert not fatal
    *_, zombies, last = records_of(cfg.bootstrap, topic, mine[0].key)
    assert zombies.value == (mine[1] if newest == "a tombstone" else mine[0]).value, "not the zombie's record"
    assert dict(last.headers) == dict(mine[-1].headers), "not the newest record as first written"
    if newest == "a tombstone":
        assert last.value is None
    else:
        again, first = (engine.schemas.decode(r.value) for r in (last, mine[-1]))
        assert again["op"] == "u" and again["after"]["note"] == "changed"
        assert {k: v for k, v in again.items() if not k.startswith("ts_")} == {
            k: v for k, v in first.items() if not k.startswith("ts_")
        }, "the event's payload or transaction block differs from the first"
        assert again["transaction"] is not None


@pytest.mark.slow
@pytest.mark.parametrize(("how", "on"), [("handed over", "table topic"), ("after a crash", "table topic"),
                                         ("handed over", "Debezium topic"), ("after a crash", "Debezium topic")])
def test_an_old_table_record_the_owner_had_not_examined_when_the_raw_partition_moved_is_found_by_the_next_owner(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], local_stack: StackConfig, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, how: str, on: str,
) -> None:  # fmt: skip
    """A zombie's old record lands after the owner's last one of the partition, and the owner gives up the raw
    partition (or dies) before it looks: its checkpoint says how far it examined each partition, and the next owner,
    another worker, examines the rest and writes the order's tombstone again (on a Debezium-format topic too)."""
    database = psycopg2.extensions.parse_dsn(pg_database)["dbname"]
    settings = {"debezium": "true", "debezium_database": database} if on == "Debezium topic" else {}
    first, fatal = shop_engine(pg_database, capture_factory, local_stack, tmp_path / "first", **settings)
    first.fanout.look_every = 3600.0  # the owner does not find the zombie's record itself
    cfg = first.cfg
    orders = first.catalog.find("orders")
    assert orders is not None
    topic = debezium_topic(cfg.dbz_prefix, "public", "orders") if settings else orders.topic
    parts = {(t.topic, p) for t in first.catalog.tables for p in range(cfg.partitions)}
    everything = parts | {(cfg.view_topic("orders_enriched"), p) for p in range(cfg.partitions)} | {first.raw}
    second, fatal_b = another_engine(local_stack, cfg.topic_prefix, tmp_path / "second", **settings)
    try:
        first.assigned(everything)
        mine = zombie_sends_an_old_order(shop_db, first, topic)
        if how == "after a crash":  # no last checkpoint: the one of its last batch, written before the zombie's
            monkeypatch.setattr(first.fanout, "save_last", lambda: None)
        first.revoked()
        second.assigned(everything)
        settled(shop_db, second)
        gone = wait_for(lambda: records_of(cfg.bootstrap, topic, mine[0].key)[-1].value is None, 60)
        assert gone, "the zombie's row is still the newest"
    finally:
        second.close()
        first.close()
    assert not fatal and not fatal_b
    last = records_of(cfg.bootstrap, topic, mine[0].key)[-1]
    assert last.value is None and last.offset > mine[-1].offset + 1, "the tombstone, written after the zombie's row"
