"""The capture agent against the real stack: snapshot, streaming, order, TOAST, schema changes."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import psycopg2
import pytest

from capture import snapshot
from headwater import shop
from headwater.reconcile import apply_changes, assert_table_matches
from tables.change import CHANGE_VALUE_SCHEMA
from tables.config import StackConfig
from tables.errors import SchemaChangeError
from tables.registry import Registry
from tests.plugins.capture import Capture

SHOP_KEYS = {"customers": ["id"], "products": ["id"], "orders": ["id"], "order_items": ["order_id", "line_no"]}


def run_workload(dsn: str, stop: threading.Event, seed: int = 11) -> shop.Workload:
    conn = psycopg2.connect(dsn)
    work = shop.Workload(conn, rng_seed=seed)
    try:
        while not stop.is_set():
            work.step()
    finally:
        conn.close()
    return work


@pytest.mark.parametrize(("parallel", "images"), [(False, "framed"), (True, "framed"), (True, "nested")],
                         ids=["in-process", "worker-processes", "worker-processes-nested"])
def test_snapshot_with_concurrent_writes_equals_final_tables(
    pg_database: str,
    shop_db: psycopg2.extensions.connection,
    capture_factory: Callable[..., Capture],
    monkeypatch: pytest.MonkeyPatch,
    parallel: bool,
    images: str,
) -> None:
    monkeypatch.setattr(snapshot, "PARALLEL_MIN_ROWS", 0 if parallel else 10**12)
    shop.seed(shop_db, shop.Scale(customers=300, products=40, orders=1500, description_size=3000), rng_seed=2)
    before = shop.counts(shop_db)
    stop = threading.Event()
    writer = threading.Thread(target=run_workload, args=(pg_database, stop))
    writer.start()
    time.sleep(0.3)
    capture = capture_factory(pg_database, snapshot_workers=2, snapshot_chunk_pages=4, raw_images=images).start()
    time.sleep(4)  # writes keep landing during and after the snapshot
    stop.set()
    writer.join()
    capture.wait_caught_up(pg_database)
    capture.stop()

    changes = capture.changes()
    decode = Registry(capture.cfg.registry_url)
    reads = [c for c in changes if c["op"] == "READ"]
    ends = [c for c in changes if c["op"] == "SNAPSHOT_END"]
    assert len(ends) == 1 and ends[0]["tx_size"] == len(reads)
    positions = [c["position"] for c in reads] + [ends[0]["position"]]
    assert len(set(positions)) == len(positions), "snapshot positions must be unique"
    per_key = Counter((c["table"], c["key"]) for c in reads)
    assert max(per_key.values()) == 1, "a row was read twice by the snapshot"
    assert sum(1 for c in reads if c["table"] == "orders") >= before["orders"] - 50  # deletes may race
    streamed = [c for c in changes if c["op"] in ("INSERT", "UPDATE", "DELETE")]
    assert streamed, "the workload's changes were not captured"
    assert all(c["commit_lsn"] > ends[0]["commit_lsn"] for c in streamed)

    state = apply_changes(changes, decode)
    for table, key in SHOP_KEYS.items():
        assert assert_table_matches(shop_db, table, key, state.get(table, {})) > 0


def test_commit_order_positions_and_aborted_transactions(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE a (id int PRIMARY KEY, v text); CREATE TABLE b (id int PRIMARY KEY, a_id int)")
    capture = capture_factory(pg_database).start()
    time.sleep(1.5)
    with conn, conn.cursor() as cur:  # tx 1: three changes over two tables
        cur.execute("INSERT INTO a VALUES (1, 'one'), (2, 'two'); INSERT INTO b VALUES (10, 1)")
    with conn.cursor() as cur:  # aborted: must leave nothing
        cur.execute("INSERT INTO a VALUES (3, 'never'); UPDATE b SET a_id = 2")
    conn.rollback()
    with conn, conn.cursor() as cur:  # tx 2: update + delete across tables
        cur.execute(
            "UPDATE a SET v = 'uno' WHERE id = 1; DELETE FROM b WHERE id = 10; UPDATE a SET v = 'dos' WHERE id = 2"
        )
    with conn, conn.cursor() as cur:  # tx 3: truncate
        cur.execute("TRUNCATE b")
    capture.wait_caught_up(pg_database)
    capture.stop()
    conn.close()

    changes = [c for c in capture.changes() if c["op"] != "SNAPSHOT_END"]
    decode = Registry(capture.cfg.registry_url)
    summary = [(c["op"], c["table"], c["position"], c["tx_size"]) for c in changes]
    assert summary == [
        ("INSERT", "a", 0, 3), ("INSERT", "a", 1, 3), ("INSERT", "b", 2, 3),
        ("UPDATE", "a", 0, 3), ("DELETE", "b", 1, 3), ("UPDATE", "a", 2, 3),
        ("TRUNCATE", "b", 0, 1),
    ]  # fmt: skip
    lsns = [c["commit_lsn"] for c in changes]
    assert lsns == sorted(lsns) and len(set(lsns)) == 3
    assert len({c["xid"] for c in changes}) == 3
    assert all(decode(c["after"]).get("v") != "never" for c in changes if c["after"])
    assert decode(changes[3]["after"]) == {"id": 1, "v": "uno"}
    assert decode(changes[4]["key"]) == {"id": 10} and changes[4]["after"] is None


def test_unchanged_toast_value_is_carried(
    pg_database: str, shop_db: psycopg2.extensions.connection, capture_factory: Callable[..., Capture]
) -> None:
    capture = capture_factory(pg_database).start()
    time.sleep(1.5)
    with shop_db, shop_db.cursor() as cur:
        cur.execute("INSERT INTO products (sku, name, category, price, description) VALUES ('T1', 't', 'books', 1, %s)",
                    ("x" * 50_000,))  # fmt: skip
    with shop_db, shop_db.cursor() as cur:  # only small columns change: description is 'unchanged toast'
        cur.execute("UPDATE products SET price = price + 1 WHERE sku = 'T1'")
        cur.execute("UPDATE products SET price = price + 1 WHERE id = (SELECT min(id) FROM products)")
        cur.execute("SELECT id, description FROM products ORDER BY id")
        descriptions = dict(cur.fetchall())
    capture.wait_caught_up(pg_database)
    capture.stop()
    decode = Registry(capture.cfg.registry_url)
    updates = [decode(c["after"]) for c in capture.changes() if c["op"] == "UPDATE"]
    assert len(updates) == 2
    for row in updates:
        assert row["description"] == descriptions[row["id"]]  # the seeded one came from the snapshot's cache


def test_alter_table_registers_new_version_and_keeps_streaming(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY, a int)")
        cur.execute("INSERT INTO t VALUES (1, 1)")
    capture = capture_factory(pg_database).start()
    time.sleep(1.5)
    with conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE t ADD COLUMN note text")
        cur.execute("INSERT INTO t VALUES (2, 2, 'hello')")
        cur.execute("ALTER TABLE t ALTER COLUMN a TYPE bigint")
        cur.execute("INSERT INTO t VALUES (3, 3, 'widened')")
        cur.execute("ALTER TABLE t RENAME COLUMN note TO remark")
        cur.execute("INSERT INTO t VALUES (4, 4, 'renamed')")
    capture.wait_caught_up(pg_database)
    capture.stop()
    decode = Registry(capture.cfg.registry_url)
    rows = [decode(c["after"]) for c in capture.changes() if c["op"] in ("READ", "INSERT")]
    assert rows == [
        {"id": 1, "a": 1},
        {"id": 2, "a": 2, "note": "hello"},
        {"id": 3, "a": 3, "note": "widened"},
        {"id": 4, "a": 4, "remark": "renamed"},
    ]
    subject = f"{capture.cfg.topic_prefix}.t-value"
    assert httpx.get(f"{capture.cfg.registry_url}/subjects/{subject}/versions").json() == [1, 2, 3, 4]
    conn.close()


def test_incompatible_change_stops_with_table_and_fix(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY, a int)")
    capture = capture_factory(pg_database).start()
    time.sleep(1.5)
    with conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE t ALTER COLUMN a TYPE text")  # int -> string: old data unreadable
        cur.execute("INSERT INTO t VALUES (1, 'x')")
    error = capture.failure()
    assert isinstance(error, SchemaChangeError)
    message = str(error)
    assert "public.t" in message and "-value" in message and "hint" in message
    conn.close()


def test_idle_tables_heartbeat_advances_the_slot(pg_database: str, capture_factory: Callable[..., Capture]) -> None:
    conn = psycopg2.connect(pg_database)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE captured (id int PRIMARY KEY); CREATE TABLE other (id serial PRIMARY KEY, pad text)")
    capture = capture_factory(pg_database, include="public.captured", heartbeat_interval=0.5).start()
    time.sleep(1.5)

    def confirmed() -> Any:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s", (capture.cfg.slot,)
            )
            return cur.fetchone()[0]

    start = confirmed()
    with conn.cursor() as cur:  # the database is busy elsewhere: WAL grows, captured table idle
        for _ in range(20):
            cur.execute("INSERT INTO other (pad) SELECT repeat('x', 1000) FROM generate_series(1, 200)")
    time.sleep(3)
    with conn.cursor() as cur:
        cur.execute(
            "SELECT %s::pg_lsn < %s::pg_lsn, pg_current_wal_lsn() - %s::pg_lsn", (start, confirmed(), confirmed())
        )
        advanced, behind = cur.fetchone()
    capture.stop()
    conn.close()
    assert advanced, "the slot did not advance while only uncaptured tables changed"
    assert behind < 200_000


def test_json_format_needs_no_registry(pg_database: str, capture_factory: Callable[..., Capture]) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute(
            "CREATE TABLE j (id int PRIMARY KEY, price numeric(8,2), at timestamptz, day date, doc jsonb, raw bytea,"
            " tags text[], ratio double precision)"
        )
        cur.execute(
            "INSERT INTO j VALUES (1, 12.50, '2024-02-29 12:00:00.5+02', '2024-02-29', '{\"a\": [1]}', '\\x0001',"
            " '{x,NULL}', 'NaN')"
        )
    nowhere = "http://127.0.0.1:9"  # the json format must not need a registry
    capture = capture_factory(pg_database, format="json", registry_url=nowhere).start()
    time.sleep(1.5)
    with conn, conn.cursor() as cur:
        cur.execute("UPDATE j SET price = 13 WHERE id = 1")
        cur.execute("DELETE FROM j")
    capture.wait_caught_up(pg_database)
    capture.stop()
    conn.close()
    from tables.kafka import read_topic

    records = read_topic(capture.cfg.bootstrap, capture.cfg.changes_topic)
    changes = [json.loads(r.value) for r in records if r.value is not None]
    assert json.loads(records[0].key) == {"schema": "public", "table": "j"}
    assert [c["op"] for c in changes] == ["READ", "SNAPSHOT_END", "UPDATE", "DELETE"]
    read, update, delete = changes[0], changes[2], changes[3]
    assert read["after"] == {
        "id": 1, "price": "12.50", "at": "2024-02-29T10:00:00.500000Z", "day": "2024-02-29", "doc": {"a": [1]},
        "raw": "AAE=", "tags": ["x", None], "ratio": "NaN",
    }  # fmt: skip
    assert read["key"] == {"id": 1} and changes[1]["tx_size"] == 1
    assert update["after"]["price"] == "13.00" and update["position"] == 0 and update["tx_size"] == 2  # one tx
    assert update["commit_time"].endswith("Z") and update["commit_lsn"] > read["commit_lsn"]
    assert delete["key"] == {"id": 1} and delete["after"] is None and delete["position"] == 1


@pytest.mark.parametrize("allow", [False, True], ids=["skipped", "allowed"])
def test_unkeyed_tables(pg_database: str, capture_factory: Callable[..., Capture], allow: bool) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE keyed (id int PRIMARY KEY); CREATE TABLE loose (a int, b text)")
        cur.execute("ALTER TABLE loose REPLICA IDENTITY FULL")  # else PostgreSQL refuses its updates
        cur.execute("INSERT INTO keyed VALUES (1); INSERT INTO loose VALUES (1, 'x')")
    capture = capture_factory(pg_database, allow_unkeyed=allow).start()
    capture.wait_caught_up(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("UPDATE loose SET b = 'y'; DELETE FROM loose; INSERT INTO keyed VALUES (2)")
    capture.wait_caught_up(pg_database)
    capture.stop()
    conn.close()
    decode = Registry(capture.cfg.registry_url)
    loose = [c for c in capture.changes() if c["table"] == "loose"]
    if not allow:
        assert loose == []
        return
    assert [c["op"] for c in loose] == ["READ", "UPDATE", "DELETE"]
    assert all(c["key"] is None for c in loose)
    assert decode(loose[1]["before"]) == {"a": 1, "b": "x"} and decode(loose[1]["after"]) == {"a": 1, "b": "y"}
    assert decode(loose[2]["before"]) == {"a": 1, "b": "y"} and loose[2]["after"] is None


@pytest.mark.parametrize("level", ["BACKWARD", "FORWARD", "FULL_TRANSITIVE"])
def test_the_raw_record_with_backfill_registers_over_the_one_before_it(
    local_stack: StackConfig, unique_name: str, level: str
) -> None:
    """A raw topic written before ``backfill`` existed: capture's new schema is a compatible next version."""
    registry = Registry(local_stack.registry_url)
    subject = f"{unique_name}.changes-value"
    before = {**CHANGE_VALUE_SCHEMA, "fields": [f for f in CHANGE_VALUE_SCHEMA["fields"] if f["name"] != "backfill"]}
    first = registry.register(subject, before)
    httpx.put(f"{local_stack.registry_url}/config/{subject}", json={"compatibility": level}).raise_for_status()
    assert registry.register(subject, CHANGE_VALUE_SCHEMA) != first
    registry.close()
