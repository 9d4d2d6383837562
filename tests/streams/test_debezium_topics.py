"""The Debezium-format topics on the real stack: every change once, in Debezium's envelope, transactions counted,
through a worker killed mid-workload; a Debezium topic replayed by key is the table PostgreSQL has.

REPLICA IDENTITY FULL images are checked in tests/streams/test_debezium.py only: capture refuses a keyed
table whose identity is FULL (its relation message marks every column as key, see the report of issue 22)."""

from __future__ import annotations

import signal
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg2
import pytest

from headwater import shop
from headwater.reconcile import compare
from streams.debezium import NEW_KEY, OLD_KEY
from tables.kafka import Record, read_topic
from tables.registry import Registry
from tables.topics import debezium_topic, debezium_transaction_topic
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.streams import Worker
from tests.streams.test_workers import wait_for

pytestmark = pytest.mark.slow
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def events(capture: Capture, registry: Registry, table: str) -> list[tuple[Record, Any, Any]]:
    """(record, key, value) of a table's Debezium topic, decoded (tombstones: value None)."""
    topic = debezium_topic(f"{capture.cfg.topic_prefix}.debezium", "public", table)
    return [(r, registry.decode(r.key), registry.decode(r.value)) for r in read_topic(capture.cfg.bootstrap, topic)]


def replayed(found: list[tuple[Record, Any, Any]]) -> dict[bytes, dict[str, Any]]:
    """A Debezium topic read as a consumer of its envelope would: each key's last ``after``, deletes dropping it."""
    rows: dict[bytes, dict[str, Any]] = {}
    for record, _, value in sorted(found, key=lambda e: (e[0].partition, e[0].offset)):
        assert record.key is not None or value["op"] == "t"
        if value is None or value["op"] == "t":
            continue
        if value["after"] is None:
            rows.pop(record.key, None)  # type: ignore[arg-type]
        else:
            rows[record.key] = value["after"]  # type: ignore[index]
    return rows


def boundaries(capture: Capture, registry: Registry) -> list[dict[str, Any]]:
    """The BEGIN and END records of the Debezium transaction topic, decoded."""
    topic = debezium_transaction_topic(f"{capture.cfg.topic_prefix}.debezium")
    return [registry.decode(r.value) for r in read_topic(capture.cfg.bootstrap, topic)]


def per_transaction(found: dict[str, list[tuple[Record, Any, Any]]]) -> dict[str, dict[str, int]]:
    """The streamed events of each transaction, counted per table as an END record counts them."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for table, got in found.items():
        for _, _, value in got:
            if value and value["transaction"]:
                counts[value["transaction"]["id"]][f"public.{table}"] += 1
    return defaultdict(dict, {ident: dict(c) for ident, c in counts.items()})


def ended(end: dict[str, Any]) -> dict[str, int]:
    """The events an END record counts, per table."""
    return {c["data_collection"]: c["event_count"] for c in end["data_collections"]}


def test_debezium_topics_carry_every_change_once_in_the_envelope_with_transactions_through_a_killed_worker(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    capture = capture_factory(pg_database).start()
    database = psycopg2.extensions.parse_dsn(pg_database)["dbname"]
    settings = {"debezium": "true", "debezium_transactions": "true", "debezium_database": database}
    prefix = capture.cfg.topic_prefix
    worker = worker_factory(prefix, **settings).start()
    writer = shop_writer(rate=200)
    wait_for(lambda: writer.work.committed >= 300, 60)
    worker.kill(signal.SIGKILL)  # mid-workload
    worker = worker_factory(prefix, app_id=f"{prefix}-app", **settings).start()
    wait_for(lambda: writer.work.committed >= 600, 60)
    writer.stop()
    with shop_db.cursor() as cur:  # a key change and a delete (REPLICA IDENTITY DEFAULT: the old key only)
        cur.execute("INSERT INTO customers (id, email, name, region) VALUES (900001, 'k@x', 'Kay', 'north')")
        cur.execute("UPDATE customers SET id = 900002 WHERE id = 900001")
        cur.execute("DELETE FROM order_items WHERE (order_id, line_no) IN (SELECT order_id, line_no FROM order_items"
                    " ORDER BY 1, 2 LIMIT 1)")  # fmt: skip
    shop_db.commit()
    capture.wait_caught_up(pg_database)
    registry = Registry(capture.cfg.registry_url)

    def settled() -> bool:  # the last transaction's END written, and every ended one's events landed
        found = {table: events(capture, registry, table) for table in shop.TABLES}
        last = [v["transaction"]["id"] for _, _, v in found["customers"]
                if v and v["op"] == "c" and v["after"]["id"] == 900002 and v["transaction"]]  # fmt: skip
        ends = {b["id"]: b for b in boundaries(capture, registry) if b["status"] == "END"}
        counted = per_transaction(found)
        return bool(last) and last[0] in ends and all(ended(end) == counted[ident] for ident, end in ends.items())

    wait_for(settled, 90, every=1.0)  # records on other partitions land apart; on a timeout the checks below fail
    found = {table: events(capture, registry, table) for table in shop.TABLES}

    for table in shop.TABLES:  # replayed by key, each topic is the table
        count, problems = compare(shop_db, table, shop.KEYS[table], replayed(found[table]))
        assert not problems, "\n".join(problems[:20])
        assert count > 0
    every = [(t, r, k, v) for t, got in found.items() for r, k, v in got]
    once = Counter((t, dict(r.headers)["hw.lsn"], dict(r.headers)["hw.pos"], v and v["op"], k and str(k))
                   for t, r, k, v in every)  # fmt: skip
    assert [ident for ident, n in once.items() if n > 1] == []  # the killed worker's replay wrote nothing twice
    ops = Counter(v["op"] for _, _, _, v in every if v)
    assert ops["r"] == sum(1 for _, r, _, v in every if v and v["source"]["snapshot"] == "true") > 100
    assert ops["c"] > 100 and ops["u"] > 50 and ops["d"] > 10
    tombstones = sum(1 for _, _, _, v in every if v is None)
    assert tombstones == ops["d"]  # each delete is followed by its tombstone

    customers = [(r, k, v) for r, k, v in found["customers"]]
    key_change = [e for e in customers if e[2] and e[2]["op"] == "d" and e[1] == {"id": 900001}]
    assert len(key_change) == 1
    deleted, = key_change
    assert deleted[2]["before"] == {"id": 900001, "email": "", "name": "", "region": "", "created_at": EPOCH,
                                    "profile": ""}  # the old key; Debezium's fallbacks for what PostgreSQL did not send
    assert dict(deleted[0].headers)[NEW_KEY]
    created = [e for e in customers if e[2] and e[2]["op"] == "c" and e[1] == {"id": 900002}]
    assert len(created) == 1 and dict(created[0][0].headers)[OLD_KEY] == deleted[0].key
    item = next(v for _, _, v in reversed(found["order_items"]) if v and v["op"] == "d")
    assert item["before"]["quantity"] == 0 and item["before"]["unit_price"] is not None  # DEFAULT: key + fallbacks
    source = deleted[2]["source"]
    assert (source["connector"], source["db"], source["schema"], source["table"]) == ("postgresql", database,
                                                                                      "public", "customers")
    assert source["name"] == f"{prefix}.debezium" and source["lsn"] > 0 and source["txId"] > 0

    marks = boundaries(capture, registry)
    begins = Counter(b["id"] for b in marks if b["status"] == "BEGIN")
    ends = {b["id"]: b for b in marks if b["status"] == "END"}
    assert set(begins.values()) == {1} and set(begins) == set(ends) and len(ends) > 500
    per_tx = per_transaction(found)
    for ident, end in ends.items():
        assert ended(end) == per_tx[ident] and end["event_count"] == sum(per_tx[ident].values()), ident
