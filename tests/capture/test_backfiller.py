"""Backfills on the real stack: every test reconciles the raw topic and the table topics against PostgreSQL.

A writer changing and deleting the very keys being chunked, ``kill -9`` mid-backfill (with the shop
view and Redis), tables joining the captured set (added to the publication while capture runs, or
newly matched by ``include`` at start), a table without key, a role with only REPLICATION, SELECT and
the signal table's INSERT, a ``--where`` re-snapshot, and a re-snapshot that retracts keys.
"""

from __future__ import annotations

import bisect
import json
import logging
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg2
import psycopg2.extensions
import pytest

from capture import backfiller, catalog, chunker, retract
from capture.backfill import Backfill
from capture.backfiller import Candidates
from capture.config import CaptureConfig
from headwater import shop
from headwater.reconcile import apply_changes, assert_table_matches, compare, compare_endpoint, latest_rows
from tables.config import StackConfig
from tables.kafka import read_topic
from tables.registry import Registry
from tables.wire import body
from tests.capture.test_retract import KEY_TYPES, key_images, shape_of
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.streams import Worker
from tests.streams.test_views import views_reconciled
from tests.streams.test_workers import wait_for

Keys = dict[str, list[str]]  # table -> key columns


def run(dsn: str, *statements: str, user: tuple[str, str] | None = None) -> list[tuple[Any, ...]]:
    """Statements in autocommit; the last one's rows (as ``user``, a role and its password, when given)."""
    conn = psycopg2.connect(dsn, **({"user": user[0], "password": user[1]} if user else {}))
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def raw_reconciles(conn: Any, capture: Capture, tables: Keys) -> list[dict[str, Any]]:
    """The raw topic applied in order equals every table in PostgreSQL; returns the raw topic."""
    changes = capture.changes()
    state = apply_changes(changes, Registry(capture.cfg.registry_url))
    for table, key in tables.items():
        assert_table_matches(conn, table, key, state.get(table, {}))
    return changes


def topics_reconcile(conn: Any, capture: Capture, worker: Worker, tables: Keys, *, endpoint: bool = False) -> None:
    """Each table topic's latest state (the worker's fan-out), and every row its endpoint serves, equal PostgreSQL."""
    decode, prefix = Registry(capture.cfg.registry_url), capture.cfg.topic_prefix
    last: list[str] = []

    def check() -> bool:
        nonlocal last
        last = []
        for table, key in tables.items():
            last += compare(conn, table, key, latest_rows(capture.cfg.bootstrap, f"{prefix}.{table}", decode))[1]
            if endpoint and not last:
                last += compare_endpoint(conn, table, key, worker.url, table)[1]
        return not last

    assert wait_for(check, 120, every=1.0), "\n".join(last[:20]) + "\n" + worker.tail()


def chunks_of(changes: list[dict[str, Any]], backfill: int) -> dict[int, list[dict[str, Any]]]:
    """A backfill's changes by the commit LSN of their chunk, checked to be whole transactions in order."""
    chunks: dict[int, list[dict[str, Any]]] = {}
    for change in changes:
        if change["backfill"] == backfill:
            chunks.setdefault(change["commit_lsn"], []).append(change)
    for lsn, rows in chunks.items():
        assert [c["position"] for c in rows] == list(range(len(rows))), f"chunk at {lsn} is not whole, in order"
        assert {c["tx_size"] for c in rows} == {len(rows)} and len({c["op"] for c in rows}) == 1
    return chunks


def keys_read_below_its_rows(changes: list[dict[str, Any]], backfill: Backfill) -> None:
    """The raw topic's keys a backfill's retraction read lay below the end it saved as it started: none of its
    own rows (checking their keys in the table cost ~9 us each, and after a restart, every row written before)."""
    own = [c["_offset"] for c in changes if c["backfill"] == backfill.id]
    assert own and backfill.keys_end is not None and 0 < backfill.keys_end <= min(own), (backfill.keys_end, own[:3])


def assert_in_commit_order(changes: list[dict[str, Any]]) -> None:
    """Backfill chunks sit in the raw topic at their high watermark's commit, like any transaction: every
    change before a chunk committed before it, every change after it committed after it (what capture sent
    again after a crash, the same (commit LSN, position) as before, aside)."""
    seen: set[tuple[int, int]] = set()
    lsns = []
    for c in changes:
        ident = (c["commit_lsn"], c["position"])
        if c["tx_size"] and ident not in seen:  # snapshot rows (tx_size 0) share the consistent point
            lsns.append(c["commit_lsn"])
        seen.add(ident)
    assert lsns == sorted(lsns), "the raw topic is not in commit order"


def shop_pipeline(pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], **settings: Any) -> Capture:
    capture = capture_factory(pg_database, **settings)
    capture.spawn()
    capture.wait_caught_up(pg_database, timeout=120)
    return capture


# ---- a writer on the keys being chunked -------------------------------------------------------
HOT = """
CREATE TABLE hot (region text, id int, n int NOT NULL DEFAULT 0, note text, PRIMARY KEY (region, id));
ALTER TABLE hot REPLICA IDENTITY FULL;
INSERT INTO hot SELECT 'r' || (g % 4), g, 0, repeat('n', g % 400) FROM generate_series(1, 40000) g;
ANALYZE hot;
"""


class HotWriter:
    """Thousands of transactions on random keys of ``hot``, most of them just ahead of the backfill's saved
    cursor (the keys about to be chunked): updates, deletes, re-inserts of deleted keys, and key moves."""

    def __init__(self, dsn: str, capture: Capture, chunk: int) -> None:
        self.conn = psycopg2.connect(dsn)
        self.capture, self.chunk = capture, chunk
        self.keys = sorted(run(dsn, "SELECT region, id FROM hot"))
        self.deleted: list[tuple[str, int]] = []
        self.rng = random.Random(20)
        self.committed = self.during = self.moved = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        at, running = 0, True
        while not self.stop_event.is_set():
            if self.committed % 25 == 0:
                at, running = self._cursor()
            with self.conn, self.conn.cursor() as cur:
                for _ in range(self.rng.randint(1, 3)):
                    self._change(cur, at)
            self.committed += 1
            self.during += running

    def _cursor(self) -> tuple[int, bool]:
        """Where the backfill's saved cursor is in the sorted keys, and whether it is still running."""
        found = [b for b in self.capture.backfills() if b.origin == "request"]
        if not found or found[-1].cursor is None:
            return 0, not found or found[-1].status != "done"
        region, key = found[-1].cursor
        return bisect.bisect(self.keys, (region, int(key or 0))), found[-1].status == "running"

    def _change(self, cur: Any, at: int) -> None:
        rng = self.rng
        near = self.keys[at : at + 30 * self.chunk] if rng.random() < 0.8 else self.keys
        region, key = rng.choice(near or self.keys)
        kind = rng.random()
        if kind < 0.5:
            cur.execute("UPDATE hot SET n = n + 1, note = note || 'u' WHERE region = %s AND id = %s", (region, key))
        elif kind < 0.75:
            cur.execute("DELETE FROM hot WHERE region = %s AND id = %s", (region, key))
            self.deleted.append((region, key))
        elif kind < 0.9 and self.deleted:
            back = self.deleted.pop(rng.randrange(len(self.deleted)))
            cur.execute("INSERT INTO hot VALUES (%s, %s, 7, 'back') ON CONFLICT DO NOTHING", back)
        else:  # the key moves: under REPLICA IDENTITY FULL the old key is only in the old row
            self.moved += 1
            cur.execute("UPDATE hot SET id = %s WHERE region = %s AND id = %s", (10**7 + self.moved, region, key))

    def start(self) -> HotWriter:
        self.thread.start()
        return self

    def stop(self) -> int:
        self.stop_event.set()
        self.thread.join(timeout=60)
        self.conn.close()
        return self.committed


@pytest.mark.slow
def test_a_writer_changing_the_keys_being_chunked_never_loses_to_a_chunk_row(
    pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    """Re-snapshot (``headwater snapshot``) a table with a composite key under REPLICA IDENTITY FULL while a
    writer updates, deletes, re-inserts and moves the very keys being chunked: no row a chunk read overwrites
    a newer streamed change, no deleted key comes back, and the chunks drop the rows the writer touched."""
    run(pg_database, HOT)
    capture = capture_factory(pg_database, backfill_chunk_rows=100).start()
    capture.wait_caught_up(pg_database, timeout=120)
    writer = HotWriter(pg_database, capture, 100).start()
    try:
        time.sleep(0.5)
        asked = capture.snapshot("public.hot")
        assert "queued backfill #1 public.hot" in asked.stdout
        backfill = capture.wait_backfilled(pg_database, timeout=300)[0]
        wait_for(lambda: writer.committed >= 2000, 120)  # and some more after it
    finally:
        committed = writer.stop()
    capture.wait_caught_up(pg_database)
    capture.stop()

    conn = psycopg2.connect(pg_database)
    changes = raw_reconciles(conn, capture, {"hot": ["region", "id"]})
    assert writer.during >= 1000 and committed >= 2000, f"{writer.during} of {committed} during the backfill"
    assert backfill.status == "done" and backfill.dropped > 0, backfill.describe()
    chunks = chunks_of(changes, backfill.id)
    reads = sum(len(rows) for rows in chunks.values() if rows[0]["op"] == "READ")
    retracted = sum(len(rows) for rows in chunks.values() if rows[0]["op"] == "DELETE")
    assert reads == backfill.rows and len(chunks) >= 300, f"{reads} rows in {len(chunks)} chunks"
    assert retracted == backfill.retracted and all(c["table"] == "hot" for rows in chunks.values() for c in rows)
    assert_in_commit_order(changes)
    worker = worker_factory(capture.cfg.topic_prefix).start()
    topics_reconcile(conn, capture, worker, {"hot": ["region", "id"]})
    conn.close()


# ---- kill -9 ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_kill_9_mid_backfill_goes_on_from_the_last_chunk(
    local_stack: StackConfig, pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture],
    worker_factory: Callable[..., Worker], shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    """The shop under load; ``headwater snapshot orders order_items``; capture killed with ``kill -9`` while it
    chunks order_items: on restart the backfill goes on after its last acknowledged chunk, and the raw topic,
    the table topics, the view and Redis end equal to PostgreSQL (nothing lost, no phantom row)."""
    shop.seed(shop_db, shop.Scale(customers=500, products=60, orders=12000, description_size=500), rng_seed=5)
    run(pg_database, "ANALYZE")
    capture = shop_pipeline(pg_database, shop_db, capture_factory, backfill_chunk_rows=300)
    writer = shop_writer(rate=80)
    capture.snapshot("orders", "order_items", "--wait", "30")
    started = wait_for(lambda: _chunking(capture, "public.order_items", 300), 180, every=0.05)
    assert started is not None, f"order_items never chunked: {[b.describe() for b in capture.backfills()]}"
    assert started.phase == "chunks", f"order_items chunked before it was seen: {started.describe()}"
    # killed as soon as 3,000 more rows are saved, with nothing in between: `headwater status` (a process of its
    # own, seconds on a loaded machine) once stood here and CI's leg finished the ~30,000 rows meanwhile
    saved = wait_for(lambda: _chunking(capture, "public.order_items", started.rows + 3000), 180, every=0.05)
    assert saved is not None, f"order_items stopped chunking: {[b.describe() for b in capture.backfills()]}"
    assert capture.process is not None
    capture.process.kill()
    capture.process.wait()
    killed_at = len(capture.changes())  # nothing is written while capture is dead
    at_kill = next(b for b in capture.backfills() if b.table == "public.order_items")
    assert at_kill.status == "running" and at_kill.cursor is not None and at_kill.rows >= saved.rows
    assert at_kill.phase == "chunks", f"killed after its last chunk, nothing to go on from: {at_kill.describe()}"
    status = status_of(capture)  # what a user reads after the crash: the progress saved, as it stood
    assert re.search(r"backfills: 1 not finished, 1 finished.*\n    #2 public.order_items: running,"
                     rf" {at_kill.rows}/~\d+ rows, \d+ rows/s(, ETA \d+ s)?", status), status  # fmt: skip
    capture.spawn()
    capture.wait_backfilled(pg_database, count=2, timeout=300)
    committed = writer.stop()
    capture.wait_caught_up(pg_database)
    capture.stop()

    changes = raw_reconciles(shop_db, capture, shop.KEYS)
    items = [c for c in changes if c["backfill"] == at_kill.id]
    after = sum(1 for c in items if c["_offset"] >= killed_at)
    total = run(pg_database, "SELECT count(*) FROM order_items")[0][0]
    assert after <= total - at_kill.rows + 20 * 300, f"{after} rows after the restart: it started over"
    assert after > 0, f"no rows of #{at_kill.id} after the restart: killed after its last chunk ({at_kill.describe()})"
    keys_read_below_its_rows(changes, at_kill)
    assert capture.log is not None
    _, *restarted = re.split(rf"backfill #{at_kill.id} public.order_items: running[^\n]*: going on",
                             capture.log.read_text(), maxsplit=1)  # fmt: skip
    assert restarted, "the restarted capture did not say it went on with the backfill"
    reads = re.findall(rf"the raw topic holds (\d+) changes from before backfill #{at_kill.id} ", restarted[0])
    assert reads == [str(at_kill.keys_end)], f"after the restart, its keys were read up to {reads}, not where it began"
    assert committed > 100
    done = {b.table: b for b in capture.backfills()}
    assert done["public.order_items"].status == done["public.orders"].status == "done"
    assert_in_commit_order(changes)
    worker = worker_factory(capture.cfg.topic_prefix, views=shop.VIEWS_TOML).start(timeout=120)
    topics_reconcile(shop_db, capture, worker, shop.KEYS)
    views_reconciled(shop_db, capture, worker, local_stack.redis_url, timeout=180)


def status_of(capture: Capture) -> str:
    """What ``headwater status`` prints for this capture."""
    c = capture.cfg
    argv = [sys.executable, "-m", "headwater.cli", "status", "--dsn", c.dsn.reveal(), "--slot", c.slot,
            "--state-dir", str(c.state_dir)]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout


def _chunking(capture: Capture, table: str, rows: int) -> Backfill | None:
    """The table's backfill once it saved ``rows`` rows, or once it is past chunking (so a miss fails at once)."""
    found = [b for b in capture.backfills() if b.table == table and b.status != "queued"]
    if found and (found[0].rows >= rows or found[0].status != "running" or found[0].phase != "chunks"):
        return found[0]
    return None


# ---- tables that join the captured set --------------------------------------------------------
@pytest.mark.parametrize(("images", "workers"), [("framed", 2), ("nested", 1)])
@pytest.mark.slow
def test_tables_added_to_the_publication_while_capture_runs_are_backfilled(
    pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker], images: str,
    workers: int,
) -> None:
    """Two tables added to the publication of a running capture: one written to meanwhile (capture sees it in
    the stream), one left quiet (capture finds it in the publication): both end equal on every topic, and the
    workers, running all along, serve them over the endpoint without a restart."""
    run(pg_database, "CREATE TABLE zoo (id int PRIMARY KEY, name text)", "INSERT INTO zoo VALUES (1, 'a'), (2, 'b')")
    capture = capture_factory(pg_database, backfill_chunk_rows=500, raw_images=images).start()
    capture.wait_caught_up(pg_database)
    running = [worker_factory(capture.cfg.topic_prefix, discover_every=1).start() for _ in range(workers)]  # one group
    run(pg_database,
        "CREATE TABLE busy (a int, b text, v numeric(10, 2), PRIMARY KEY (a, b))",
        "INSERT INTO busy SELECT g % 100, 'b' || g, g / 3.0 FROM generate_series(1, 3000) g",
        "CREATE TABLE quiet (id bigint PRIMARY KEY, at timestamptz, tags text[])",
        "INSERT INTO quiet SELECT g, now() - g * interval '1 minute', ARRAY['x', g::text]"
        " FROM generate_series(1, 1500) g",
        f"ALTER PUBLICATION {capture.cfg.publication} ADD TABLE busy, quiet")  # fmt: skip
    conn = psycopg2.connect(pg_database)
    for n in range(200):  # changes to busy while (and before) it is backfilled
        with conn, conn.cursor() as cur:
            cur.execute("UPDATE busy SET v = v + 1 WHERE a = %s", (n % 100,))
            cur.execute("DELETE FROM busy WHERE a = %s AND b = %s", (n % 100, f"b{n * 7 + 1}"))
            cur.execute("INSERT INTO busy VALUES (%s, %s, %s)", (n, f"new{n}", n))
    found = capture.wait_backfilled(pg_database, count=2)
    capture.stop()

    assert {b.table: (b.origin, b.status) for b in found} == {"public.busy": ("new table", "done"),
                                                             "public.quiet": ("new table", "done")}  # fmt: skip
    keys = {"zoo": ["id"], "busy": ["a", "b"], "quiet": ["id"]}
    raw_reconciles(conn, capture, keys)
    for worker in running:  # each answers every key: its own partitions, the others' routed to their holder
        topics_reconcile(conn, capture, worker, keys, endpoint=True)
        assert worker.process is not None and worker.process.poll() is None, worker.tail()
        assert {t["table"] for t in worker.get("/tables/").json()["tables"]} >= {"public.busy", "public.quiet"}
        assert "now serving table public.busy" in worker.log.read_text(), worker.tail()
    new = ("public.busy", "public.quiet")

    def settled() -> bool:  # the group's assignment of the new topics may still be moving (seen once: busy held
        held = [{t["table"]: t["partitions_here"] for t in w.get("/tables/").json()["tables"]} for w in running]
        return all([h[table] for h in held] == [h["public.zoo"] for h in held] for table in new)  # whole by one)

    wait_for(settled, 30, every=0.5)  # on a timeout the checks below fail, saying how
    listed = [w.get("/tables/").json()["tables"] for w in running]
    held = [{t["table"]: t["partitions_here"] for t in tables} for tables in listed]
    for table in new:  # partition p of every table topic on one worker, as zoo's
        assert [h[table] for h in held] == [h["public.zoo"] for h in held]
        assert sorted(p for h in held for p in h[table]) == list(range(listed[0][0]["partitions"])), held
    conn.close()


@pytest.mark.slow
def test_a_worker_started_before_capture_serves_its_tables_once_capture_registers_them(
    pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker], unique_name: str,
) -> None:  # fmt: skip
    """Workers may start first: with nothing captured under their prefix (not even the raw topic) they serve
    no table, then each one capture registers, without a restart; the rebalance that brings the table's
    topic also brings the raw topic capture made meanwhile, so the fan-out starts (without it, Faust's
    consumer notices the raw topic only at its next metadata refresh, minutes later: the topic stays empty)."""
    run(pg_database, "CREATE TABLE early (id int PRIMARY KEY, v text)",
        "INSERT INTO early SELECT g, 'v' || g FROM generate_series(1, 500) g")  # fmt: skip
    worker = worker_factory(unique_name, discover_every=1).start()  # the tests' captures use it as their prefix
    assert worker.get("/tables/").json()["tables"] == []
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    run(pg_database, "UPDATE early SET v = 'changed' WHERE id % 7 = 0", "DELETE FROM early WHERE id % 11 = 0")
    conn = psycopg2.connect(pg_database)
    topics_reconcile(conn, capture, worker, {"early": ["id"]}, endpoint=True)
    conn.close()
    assert worker.process is not None and worker.process.poll() is None, worker.tail()


@pytest.mark.slow
def test_a_table_newly_matched_by_include_at_start_is_backfilled(
    pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The issue's case: capture ran with include = public.zoo while toasty (in the publication) got rows; a
    restart with include = public.zoo,public.toasty backfills toasty, whose rows from before reach its topic."""
    run(pg_database, "CREATE TABLE zoo (id int PRIMARY KEY, name text)", "INSERT INTO zoo VALUES (1, 'a')",
        "CREATE TABLE toasty (id int PRIMARY KEY, body text)")  # fmt: skip
    first = capture_factory(pg_database, include="public.zoo").start()
    first.wait_caught_up(pg_database)
    run(pg_database, "INSERT INTO toasty SELECT g, (SELECT string_agg(md5(random()::text || i), '')"
        " FROM generate_series(1, 400) i WHERE g > 0) FROM generate_series(1, 5) g",
        f"ALTER PUBLICATION {first.cfg.publication} ADD TABLE toasty",
        "INSERT INTO toasty VALUES (6, 'late')", "UPDATE toasty SET body = 'changed' WHERE id = 2")  # fmt: skip
    first.wait_caught_up(pg_database)
    first.stop()
    assert not first.backfills(), "toasty does not match include: not captured"
    capture = capture_factory(pg_database, include="public.zoo,public.toasty").start()
    found = capture.wait_backfilled(pg_database)
    run(pg_database, "UPDATE toasty SET id = id WHERE id = 3")  # unchanged TOAST value: from the backfill's cache
    capture.wait_caught_up(pg_database)
    capture.stop()

    assert [(b.table, b.origin, b.rows) for b in found] == [("public.toasty", "new table", 6)]
    assert "not cached" not in caplog.text, "the backfill keeps the TOASTed values it sent"
    conn = psycopg2.connect(pg_database)
    keys = {"zoo": ["id"], "toasty": ["id"]}
    raw_reconciles(conn, capture, keys)
    worker = worker_factory(capture.cfg.topic_prefix).start()
    topics_reconcile(conn, capture, worker, keys)
    conn.close()


@pytest.mark.slow
def test_a_json_capture_backfills_a_table_added_to_its_publication(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    """With ``format = "json"`` a backfill's rows are JSON changes too (no registry), ``backfill`` named, and
    the raw topic applied in order equals the table (exact decimals, UTC timestamps, arrays)."""
    run(pg_database, "CREATE TABLE zoo (id int PRIMARY KEY)", "INSERT INTO zoo VALUES (1)")
    capture = capture_factory(pg_database, format="json", backfill_chunk_rows=70).start()
    capture.wait_caught_up(pg_database)
    run(pg_database, "CREATE TABLE j (id int PRIMARY KEY, amount numeric(8, 2), at timestamptz, tags text[])",
        "INSERT INTO j SELECT g, g / 7.0, timestamptz '2024-05-01 12:00+02' + g * interval '1 hour',"
        " ARRAY['t' || g, NULL] FROM generate_series(1, 500) g",
        f"ALTER PUBLICATION {capture.cfg.publication} ADD TABLE j", "DELETE FROM j WHERE id % 50 = 0")  # fmt: skip
    found = capture.wait_backfilled(pg_database)
    capture.stop()

    rows: dict[int, dict[str, Any]] = {}
    for record in read_topic(capture.cfg.bootstrap, capture.cfg.changes_topic):
        change = json.loads(record.value)
        if change["table"] == "j" and change["op"] in ("READ", "DELETE"):
            assert change["op"] == "DELETE" or change["backfill"] == found[0].id
            if change["op"] == "READ":
                rows[change["key"]["id"]] = change["after"]
            else:
                rows.pop(change["key"]["id"], None)
    expected = run(pg_database, "SELECT id, amount::text, to_char(at AT TIME ZONE 'UTC',"
                   " 'YYYY-MM-DD\"T\"HH24:MI:SS'), tags FROM j ORDER BY id")  # fmt: skip
    got = sorted((r["id"], r["amount"], r["at"][:19], r["tags"]) for r in rows.values())
    assert got == [tuple(e) for e in expected] and len(got) == 490


@pytest.mark.slow
def test_chunks_over_a_composite_key_of_every_key_type_read_each_row_once(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    """Chunks of 7 rows over a nine-column key (int, text with quotes, uuid, timestamptz, numeric, bytea, date,
    enum, timestamp with infinities): each chunk starts after the last key of the one before, read back from
    its image as PostgreSQL's text, so every row is read once and none is skipped."""
    run(pg_database, KEY_TYPES, "CREATE INDEX ON k (v)")
    capture = capture_factory(pg_database, backfill_chunk_rows=7).start()
    capture.wait_caught_up(pg_database)
    capture.snapshot("k")
    found = capture.wait_backfilled(pg_database)
    capture.stop()
    conn = catalog.connect(pg_database)
    shape = shape_of(conn)
    expected = {body(image) for image in key_images(conn, shape, "avro")}  # every row's key, from PostgreSQL's text
    conn.close()
    changes = capture.changes()
    keys = [body(c["key"]) for c in changes if c["backfill"] == found[0].id]
    assert len(keys) == len(set(keys)) == 60 == found[0].rows and set(keys) == expected
    assert len(chunks_of(changes, found[0].id)) == 9


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_queued_backfill_whose_table_was_dropped_fails_alone(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    """``headwater snapshot items gone``; ``gone`` is dropped while ``items`` is chunked: its backfill fails
    saying so when its turn comes, and capture goes on (it once raised into the stream loop)."""
    run(pg_database, *ITEMS, "CREATE TABLE gone (id int PRIMARY KEY)", "INSERT INTO gone VALUES (1), (2)")
    capture = capture_factory(pg_database, backfill_chunk_rows=10).start()
    capture.wait_caught_up(pg_database)
    asked = capture.snapshot("items", "gone", "--wait", "60")
    assert "queued backfill" in asked.stdout, asked.stdout  # handled before the drop, or the test means nothing
    run(pg_database, "DROP TABLE gone")
    found = {b.table: b for b in capture.wait_backfilled(pg_database, count=2)}
    capture.stop()
    assert found["public.items"].status == "done" and found["public.items"].rows == 3000, found["public.items"]
    assert found["public.gone"].status == "failed" and "no longer exists" in found["public.gone"].message


@pytest.mark.slow
def test_a_table_without_key_is_refused_unless_allow_unkeyed(
    pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    run(pg_database, "CREATE TABLE keyed (id int PRIMARY KEY, v text)", "INSERT INTO keyed VALUES (1, 'x')",
        "CREATE TABLE loose (v text)", "INSERT INTO loose SELECT 'v' || g FROM generate_series(1, 900) g")  # fmt: skip
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    refused = capture.snapshot("public.loose", check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "public.loose has no primary key or replica identity index" in refused.stderr
    assert "set allow_unkeyed" in refused.stderr
    capture.stop()
    assert not capture.backfills()

    unkeyed = capture_factory(pg_database, allow_unkeyed=True, slot=capture.cfg.slot + "_u",
                              publication=capture.cfg.publication + "_u", topic_prefix=capture.cfg.topic_prefix + "_u",
                              backfill_chunk_rows=100).start()  # fmt: skip
    unkeyed.wait_caught_up(pg_database)
    assert "queued backfill #1 public.loose" in unkeyed.snapshot("loose").stdout
    found = unkeyed.wait_backfilled(pg_database)
    unkeyed.stop()
    assert found[0].status == "done" and found[0].rows == 900
    reads = [c for c in unkeyed.changes() if c["backfill"] == found[0].id]
    assert len(reads) == 900 and all(c["key"] is None for c in reads), "rows without key, each once"
    conn = psycopg2.connect(pg_database)
    raw_reconciles(conn, unkeyed, {"keyed": ["id"]})
    worker = worker_factory(unkeyed.cfg.topic_prefix).start()
    topics_reconcile(conn, unkeyed, worker, {"keyed": ["id"]})
    conn.close()


# ---- a role with only REPLICATION, SELECT and the signal table's INSERT -------------------------
@pytest.mark.slow
def test_a_backfill_under_a_role_with_only_replication_select_and_the_signal_tables_insert(
    pg_database: str, unique_name: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    """Capture runs as a role that may only replicate, read the tables and insert into the signal table; a
    signal inserted as that role backfills a table (and a bad signal is refused, in the log and the state)."""
    role, password = f"r_{unique_name[-8:]}", "pw-backfill"
    run(pg_database,
        "CREATE TABLE items (id int PRIMARY KEY, grp int NOT NULL, note text)",
        "INSERT INTO items SELECT g, g % 10, 'n' || g FROM generate_series(1, 4000) g",
        "CREATE TABLE headwater_signal (id text PRIMARY KEY DEFAULT gen_random_uuid()::text, type text NOT NULL,"
        " data text)",
        f"CREATE PUBLICATION {unique_name} FOR TABLE items, headwater_signal",
        f"CREATE ROLE {role} WITH LOGIN REPLICATION PASSWORD '{password}'",
        f"GRANT SELECT ON items TO {role}",
        f"GRANT INSERT ON headwater_signal TO {role}")  # fmt: skip
    dsn = pg_database.replace("user=headwater", f"user={role}").replace("password=headwater", f"password={password}")
    try:
        signalled(pg_database, dsn, role, password, capture_factory, worker_factory)
    finally:
        run(pg_database, f"DROP OWNED BY {role}")
        run(pg_database.replace(f"dbname={unique_name}", "dbname=postgres"), f"DROP ROLE {role}")


def signalled(pg_database: str, dsn: str, role: str, password: str, capture_factory: Callable[..., Capture],
              worker_factory: Callable[..., Worker]) -> None:  # fmt: skip
    capture = capture_factory(dsn, signal_table="public.headwater_signal", backfill_chunk_rows=300).start()
    capture.wait_caught_up(pg_database)
    signal = ('INSERT INTO headwater_signal (type, data) VALUES (\'execute-snapshot\','
              ' \'{"data-collections": ["public.items"], "type": "incremental"}\')')  # fmt: skip
    bad = "INSERT INTO headwater_signal (type, data) VALUES ('execute-snapshot', '{\"data-collections\": [\"nope\"]}')"
    run(pg_database, bad, signal, user=(role, password))
    run(pg_database, "UPDATE items SET note = 'during' WHERE id % 97 = 0")
    found = capture.wait_backfilled(pg_database)
    capture.stop()

    assert [(b.table, b.origin, b.status, b.rows + b.dropped) for b in found] == [("public.items", "signal", "done",
                                                                                   4000)]  # fmt: skip
    conn = psycopg2.connect(pg_database)
    changes = raw_reconciles(conn, capture, {"items": ["id"]})
    assert not any(c["table"] == "headwater_signal" for c in changes), "signals are not captured rows"
    assert len([c for c in changes if c["backfill"] == found[0].id]) == found[0].rows
    worker = worker_factory(capture.cfg.topic_prefix).start()
    topics_reconcile(conn, capture, worker, {"items": ["id"]})
    conn.close()
    status = capture.snapshot("--status").stdout
    assert f"#1 public.items: done, {found[0].rows} rows" in status and "(signal)" in status, status
    assert "there is no table public.nope" in status, "the refused signal is listed with why"
    worker.kill()


# ---- re-snapshots -----------------------------------------------------------------------------
ITEMS = ("CREATE TABLE items (id int PRIMARY KEY, grp int NOT NULL, note text)",
         "INSERT INTO items SELECT g, g % 10, 'n' || g FROM generate_series(1, 3000) g")  # fmt: skip


@pytest.mark.slow
def test_a_where_resnapshot_reads_only_the_rows_it_matches(
    pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    """``headwater snapshot items --where 'grp = 3'`` copies exactly those rows again; --pause, --resume,
    --cancel and --status do what they say; a predicate that could escape its parentheses is refused."""
    run(pg_database, *ITEMS)
    capture = capture_factory(pg_database, backfill_chunk_rows=50).start()
    capture.wait_caught_up(pg_database)
    escape = capture.snapshot("items", "--where", "grp = 3) OR (true", check=False)
    assert escape.returncode == 2 and "parentheses" in escape.stderr
    wrong = capture.snapshot("items", "--where", "no_such_column = 3", check=False)
    assert wrong.returncode == 2 and "PostgreSQL refuses the predicate" in wrong.stderr
    assert "queued backfill #1 public.items where grp = 3" in capture.snapshot("items", "--where", "grp = 3").stdout
    found = capture.wait_backfilled(pg_database)
    assert capture.snapshot("items").returncode == 0  # a second one, paused and resumed, then one cancelled
    paused = capture.snapshot("--pause", "items", check=False)
    capture.snapshot("--resume", check=False)
    found = capture.wait_backfilled(pg_database, count=2)
    assert "no backfill to cancel" in capture.snapshot("--cancel", check=False).stderr
    capture.stop()

    assert (found[0].rows, found[0].predicate) == (300, "grp = 3") and found[1].rows == 3000, found
    assert paused.returncode == 0 or "no backfill to pause" in paused.stderr  # it may have finished first
    conn = psycopg2.connect(pg_database)
    changes = raw_reconciles(conn, capture, {"items": ["id"]})
    read = [Registry(capture.cfg.registry_url)(c["key"])["id"] for c in changes if c["backfill"] == found[0].id]
    assert sorted(read) == [i for i in range(1, 3001) if i % 10 == 3]
    worker = worker_factory(capture.cfg.topic_prefix).start()
    topics_reconcile(conn, capture, worker, {"items": ["id"]})
    conn.close()


def lose_deletes(dsn: str, capture: Capture, *also: str) -> None:
    """Every 7th row of ``items`` deleted (and ``also`` run) while the table is out of the publication: the raw topic
    goes wrong, as a topic a re-snapshot repairs."""
    publication = capture.cfg.publication
    run(dsn, f"ALTER PUBLICATION {publication} DROP TABLE items", "DELETE FROM items WHERE id % 7 = 0", *also,
        f"ALTER PUBLICATION {publication} ADD TABLE items")  # fmt: skip
    capture.wait_caught_up(dsn)


@pytest.mark.slow
def test_a_resnapshot_retracts_keys_the_table_no_longer_has(
    pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    """Rows deleted while the table was out of the publication never reached the topic: the topic went wrong.
    ``headwater snapshot items`` repairs it: a DELETE (tombstone) for each key the table no longer has."""
    run(pg_database, *ITEMS)
    capture = capture_factory(pg_database, backfill_chunk_rows=400).start()
    capture.wait_caught_up(pg_database)
    lose_deletes(pg_database, capture, "UPDATE items SET note = 'unseen' WHERE id % 11 = 0")
    conn = psycopg2.connect(pg_database)
    wrong = apply_changes(capture.changes(), Registry(capture.cfg.registry_url))["items"]
    assert len(compare(conn, "items", ["id"], wrong)[1]) > 400, "the topic did not go wrong"
    capture.snapshot("items")
    found = capture.wait_backfilled(pg_database)
    capture.stop()

    deleted = [i for i in range(1, 3001) if i % 7 == 0]
    assert found[0].retracted == len(deleted) and found[0].rows == 3000 - len(deleted), found[0].describe()
    changes = raw_reconciles(conn, capture, {"items": ["id"]})
    decode = Registry(capture.cfg.registry_url)
    retracted = [c for c in changes if c["backfill"] == found[0].id and c["op"] == "DELETE"]
    assert sorted(decode(c["key"])["id"] for c in retracted) == deleted
    chunks_of(changes, found[0].id)
    keys_read_below_its_rows(changes, found[0])
    # what a restart of this backfill would read: the keys below its end, less the DELETEs it wrote past it
    items, end = ("public", "items"), found[0].keys_end
    ids = lambda live: sorted(decode(k)["id"] for k in live.keys[items])  # noqa: E731
    assert ids(retract.earlier_keys(capture.cfg, [items], decode, end=end)) == list(range(1, 3001))
    restarted = retract.earlier_keys(capture.cfg, [items], decode, end=end, removed_to=retract.raw_end(capture.cfg))
    assert ids(restarted) == [i for i in range(1, 3001) if i % 7], "a restart would retract its keys twice"
    worker = worker_factory(capture.cfg.topic_prefix).start()
    topics_reconcile(conn, capture, worker, {"items": ["id"]})
    conn.close()


@pytest.mark.slow
def test_a_resnapshot_after_a_key_columns_scale_changed_looks_up_the_keys_the_old_key_schema_framed(
    pg_database: str, capture_factory: Callable[..., Capture], caplog: pytest.LogCaptureFixture
) -> None:
    """``numeric(10,2)`` made ``numeric(10,3)``: 1.50 under the old key schema and 0.150 under the new one have the
    same Avro body. A chunk reading 0.150 says nothing of 1.50, deleted while the table was out of the publication:
    it is looked up, and gets its DELETE. Capture warns that the key changed (the table topics keep the old keys)."""
    run(pg_database, "CREATE TABLE prices (id numeric(10,2) PRIMARY KEY, note text)",
        "INSERT INTO prices VALUES (1.50, 'lost'), (2.00, 'kept')")  # fmt: skip
    caplog.set_level(logging.WARNING, "headwater.capture")
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    publication = capture.cfg.publication
    run(pg_database, f"ALTER PUBLICATION {publication} DROP TABLE prices", "DELETE FROM prices WHERE id = 1.50",
        f"ALTER PUBLICATION {publication} ADD TABLE prices", "ALTER TABLE prices ALTER COLUMN id TYPE numeric(10,3)",
        "INSERT INTO prices VALUES (0.150, 'new')")  # fmt: skip
    capture.wait_caught_up(pg_database)
    capture.snapshot("prices")
    found = capture.wait_backfilled(pg_database)
    capture.stop()

    assert (found[0].rows, found[0].retracted) == (2, 1), found[0].describe()
    conn = psycopg2.connect(pg_database)
    changes = raw_reconciles(conn, capture, {"prices": ["id"]})
    decode = Registry(capture.cfg.registry_url)
    retracted = [decode(c["key"])["id"] for c in changes if c["backfill"] == found[0].id and c["op"] == "DELETE"]
    assert [str(k) for k in retracted] == ["1.50"]
    assert len(re.findall(r"the key of public.prices changed \(key schema id \d+, was \d+\)", caplog.text)) == 1
    conn.close()


@pytest.mark.slow
def test_a_resnapshot_whose_keys_are_read_after_its_chunk_leaves_out_what_the_chunk_read(
    pg_database: str, capture_factory: Callable[..., Capture], caplog: pytest.LogCaptureFixture
) -> None:
    """The raw topic holds a long history of the table and one chunk reads all of it, so the chunk is likely read
    before the topic's keys are: what it read is left out then, and each key the table lost still gets its DELETE."""
    run(pg_database, *ITEMS)
    capture = capture_factory(pg_database, backfill_chunk_rows=5000).start()
    caplog.set_level(logging.INFO, "headwater.capture")
    run(pg_database, *(["UPDATE items SET note = note || '.'"] * 20))  # 60,000 changes to read
    capture.wait_caught_up(pg_database, timeout=120)
    lose_deletes(pg_database, capture)
    capture.snapshot("items")
    found = capture.wait_backfilled(pg_database)
    capture.stop()

    deleted = [i for i in range(1, 3001) if i % 7 == 0]
    assert found[0].retracted == len(deleted) and found[0].rows == 3000 - len(deleted), found[0].describe()
    said = (r"(\d+) of the (\d+) keys the raw topic holds for public.items were read by its chunks \((\d+) of them"
            r" before the keys were known\); looking for the other (\d+)")  # fmt: skip
    told = re.search(said, caplog.text)
    assert told is not None, caplog.text[-3000:]
    assert [int(told[i]) for i in (1, 2, 4)] == [3000 - len(deleted), 3000, len(deleted)], told[0]
    print(f"keys left out before they were known: {told[3]}")  # which path this run took (timing decides)
    conn = psycopg2.connect(pg_database)
    raw_reconciles(conn, capture, {"items": ["id"]})
    conn.close()


@pytest.mark.slow
def test_a_resnapshot_killed_mid_chunks_looks_up_only_the_keys_its_rows_do_not_cover(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    """A re-snapshot of a table whose topic holds its keys, ``kill -9`` after some chunks: after the restart the
    keys of the rows it wrote before need no look-up (every chunk vouched); only the keys the table lost are looked
    for, each gets its DELETE, and the raw topic ends equal to the table."""
    run(pg_database, "CREATE TABLE items (id int PRIMARY KEY, grp int NOT NULL, note text)",
        "INSERT INTO items SELECT g, g % 10, 'n' || g FROM generate_series(1, 8000) g")  # fmt: skip
    capture = capture_factory(pg_database, backfill_chunk_rows=50)
    capture.spawn()
    capture.wait_caught_up(pg_database, timeout=120)
    lose_deletes(pg_database, capture)
    capture.snapshot("items")
    saved = wait_for(lambda: _chunking(capture, "public.items", 1000), 120, every=0.05)
    assert saved is not None and saved.phase == "chunks", [b.describe() for b in capture.backfills()]
    assert capture.process is not None
    capture.process.kill()
    capture.process.wait()
    at_kill = next(b for b in capture.backfills() if b.table == "public.items")
    assert at_kill.status == "running" and at_kill.phase == "chunks", f"killed after its chunks: {at_kill.describe()}"
    assert at_kill.vouched is True, at_kill
    capture.spawn()
    found = capture.wait_backfilled(pg_database, timeout=180)
    capture.stop()

    deleted = [i for i in range(1, 8001) if i % 7 == 0]
    assert found[0].retracted == len(deleted) and found[0].rows == 8000 - len(deleted), found[0].describe()
    assert capture.log is not None
    _, restarted = capture.log.read_text().split(f"backfill #{at_kill.id} public.items: running", maxsplit=1)
    written = re.search(rf"backfill #{at_kill.id}: (\d+) of the keys the raw topic holds for public.items were read by"
                        r" the chunks it wrote before it was restarted", restarted)  # fmt: skip
    assert written is not None and int(written[1]) >= at_kill.rows, restarted[-3000:]
    looked = re.search(rf"backfill #{at_kill.id}: \d+ of the 8000 keys .* looking for the other (\d+)", restarted)
    assert looked is not None and int(looked[1]) == len(deleted), restarted[-3000:]
    conn = psycopg2.connect(pg_database)
    raw_reconciles(conn, capture, {"items": ["id"]})
    conn.close()


def candidates(keys: list[bytes] | None) -> Candidates:
    """Candidates of ``public.t`` with their keys as if read from the raw topic (no thread started)."""
    found = Candidates(CaptureConfig(), ("public", "t"), "backfill #1")
    found.keys = keys
    return found


def framed(schema_id: int, *bodies: bytes) -> list[bytes]:
    return [b"\0" + schema_id.to_bytes(4, "big") + b for b in bodies]


@pytest.mark.unit
def test_keys_a_chunk_read_are_not_looked_for_by_the_retraction() -> None:
    """A key some chunk read was in the table after the backfill began: the stream carries any later delete of
    it. Only the others are handed out, in their order. A key framed by another schema id is not taken for one
    held (under another key schema the same bytes may be another value: ``numeric(10,2)`` made ``numeric(10,3)``)."""
    found = candidates(framed(1, b"a", b"b", b"c") + framed(2, b"d", b"e"))
    found.read_in([(k, b"row") for k in framed(1, b"b", b"x")] + [(None, b"unkeyed")])
    found.read_in([(k, b"row") for k in framed(2, b"e")])
    found.read_in([(k, b"row") for k in framed(3, b"a", b"d")])
    assert found.batch(lambda key: False) == (3, framed(1, b"a", b"c") + framed(2, b"d"))
    assert found.batch(lambda key: False) == (0, [])


@pytest.mark.unit
def test_rows_read_before_the_keys_are_known_are_left_out_as_they_come_and_rows_read_once_handed_out_change_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(backfiller, "EARLY_KEYS", 3)
    found = candidates(None)
    found.read_in([(k, b"row") for k in framed(1, b"a")])
    found.read_in([(k, b"row") for k in framed(2, b"c")])
    found.read_in([(k, b"row") for k in framed(3, b"b")])  # another frame: its bytes may be another key
    found.read_in([(k, b"row") for k in framed(1, b"d", b"e")])  # past EARLY_KEYS: not kept, so looked for
    assert found.batch(lambda key: False) is None
    found._publish(framed(1, b"a", b"b") + framed(2, b"c", b"d", b"f"))
    assert found.keys == framed(1, b"b") + framed(2, b"d", b"f") and not found.early
    found.read_in([(k, b"row") for k in framed(2, b"f")])  # once they are known, before they are handed out
    assert found.batch(lambda key: key == framed(1, b"b")[0]) == (2, framed(2, b"d"))
    found.read_in([(k, b"row") for k in framed(1, b"b", b"d")])
    found.rewind()
    assert found.batch(lambda key: False) == (2, framed(1, b"b") + framed(2, b"d"))


@pytest.mark.unit
def test_chunks_read_while_the_keys_are_published_are_left_out_by_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_publish`` hands the keys over after ``PUBLISH_PASSES``: a chunk read during the last pass stays in
    ``early``, and the stream leaves its keys out before the first batch."""
    monkeypatch.setattr(backfiller, "PUBLISH_PASSES", 1)
    found = candidates(None)
    found.read_in([(k, b"row") for k in framed(1, b"a")])
    unread = found._unread

    def a_chunk_comes_meanwhile(keys: list[bytes], chunks: list[list[bytes]]) -> list[bytes]:
        found.read_in([(k, b"row") for k in framed(1, b"c")])
        return unread(keys, chunks)

    monkeypatch.setattr(found, "_unread", a_chunk_comes_meanwhile)
    found._publish(framed(1, b"a", b"b", b"c", b"d"))
    assert found.keys == framed(1, b"b", b"c", b"d") and found.early == [framed(1, b"c")]
    assert found.batch(lambda key: False) == (2, framed(1, b"b", b"d"))
    assert (found.left_out, found.marked_early) == (1, 1)  # both read before the keys were known


@pytest.mark.slow
def test_the_watch_starts_above_every_xid_assigned_and_only_where_every_delete_is_published(pg_database: str) -> None:
    """``chunker.watch_start``: an xid above that of a transaction still open (a commit that may be streamed
    yet invisible to a chunk), and None where the publication leaves deletes or truncates out or filters rows."""
    run(pg_database, "CREATE TABLE w (id int PRIMARY KEY)", "CREATE PUBLICATION everything FOR TABLE w",
        "CREATE PUBLICATION no_deletes FOR TABLE w WITH (publish = 'insert, update, truncate')",
        "CREATE PUBLICATION filtered FOR TABLE w WHERE (id > 10)")  # fmt: skip
    conn = catalog.connect(pg_database)
    conn.autocommit = True
    ref = catalog.table_ref(conn, "public", "w")
    assert ref is not None
    open_tx = psycopg2.connect(pg_database)
    with open_tx.cursor() as cur:
        cur.execute("INSERT INTO w VALUES (1)")  # an xid assigned, its transaction not ended
        cur.execute("SELECT pg_current_xact_id()::text")
        running = int(cur.fetchone()[0])  # type: ignore[index]
    watched = chunker.watch_start(conn, "everything", ref)
    assert watched is not None and watched > running & 0xFFFFFFFF
    assert chunker.watch_start(conn, "no_deletes", ref) is None
    assert chunker.watch_start(conn, "filtered", ref) is None
    assert chunker.watch_start(conn, "nonexistent", ref) is None
    with conn.cursor() as cur:  # every call ended its transaction
        cur.execute("SELECT 1")
    assert conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    open_tx.rollback()
    open_tx.close()
    conn.close()
