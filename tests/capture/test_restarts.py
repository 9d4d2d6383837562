"""Ordinary operations: restarts after quiet periods, PostgreSQL restarted under load, PostgreSQL and the broker
away during a backfill, snapshots started over.

Each test runs the real ``headwater capture`` and reconciles what it wrote against PostgreSQL.
"""

from __future__ import annotations

import contextlib
import functools
import random
import signal
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg2
import pytest
from confluent_kafka.admin import AdminClient
from pyspark.sql import SparkSession

from analytics.config import AnalyticsConfig
from analytics.jobs import read
from capture.agent import follow
from capture.backfill import UNFINISHED, Backfill
from capture.errors import CheckpointMismatchError
from capture.state import State
from headwater import shop, stack
from headwater.reconcile import apply_changes, assert_table_matches, compare
from tables.registry import Registry
from tests.analytics.test_shop import plain
from tests.capture.test_backfiller import _chunking, run
from tests.capture.test_faults import check_reconciles
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.stack import BrokerProcess, ProxiedBroker, restart_postgres
from tests.plugins.streams import Worker
from tests.streams.test_views import views_reconciled
from tests.streams.test_workers import reconciled


# ---- the checkpoint contract (no services) ---------------------------------------------------
@contextlib.contextmanager
def state_at(tmp_path: Path, confirmed: int, *, settled: bool) -> Iterator[State]:
    """A state file checkpointed at ``confirmed``, closed after use (an unclosed SQLite connection is a
    ResourceWarning from Python 3.13 on, raised wherever the garbage collector happens to find it)."""
    state = State(tmp_path / "state", "slot1")
    try:
        state.start_snapshot(0x1000, done=True)
        state.checkpoint(confirmed, confirmed - 0x10, 0, 1, 0.0, settled=settled)
        yield state
    finally:
        state.close()


@pytest.mark.unit
def test_a_slot_ahead_of_a_settled_checkpoint_is_followed(tmp_path: Path) -> None:
    with state_at(tmp_path, 0x2000, settled=True) as state:
        checkpoint = state.load()
        assert checkpoint is not None and checkpoint.settled
        follow(state, checkpoint, 0x2038)  # keepalives moved the slot 56 bytes while nothing was in flight
        assert state.load().confirmed_lsn == 0x2038  # type: ignore[union-attr]
        follow(state, state.load(), 0x2000)  # type: ignore[arg-type]  # behind or equal: nothing to do
        assert state.load().confirmed_lsn == 0x2038  # type: ignore[union-attr]


@pytest.mark.unit
def test_a_slot_ahead_of_an_unsettled_checkpoint_is_refused(tmp_path: Path) -> None:
    with state_at(tmp_path, 0x2000, settled=False) as state:
        with pytest.raises(CheckpointMismatchError, match=r"0/2038, past this checkpoint \(0/2000\)") as info:
            follow(state, state.load(), 0x2038)  # type: ignore[arg-type]
        assert info.value.hint and "drop the slot" in info.value.hint
        assert state.load().confirmed_lsn == 0x2000  # type: ignore[union-attr]


@pytest.mark.unit
def test_the_state_directory_and_files_are_private(tmp_path: Path) -> None:
    with state_at(tmp_path, 0x2000, settled=True) as state:
        state.remember("public.t", b"k", 1, 0x2000, "a TOASTed value: table data")
        state.checkpoint(0x2000, 0x1FF0, 0, 1, 0.0)
        assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
        files = list((tmp_path / "state").iterdir())
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), [
            (f.name, oct(f.stat().st_mode)) for f in files
        ]


# ---- restarts after quiet periods ------------------------------------------------------------
class OtherDatabase:
    """Writes in another database of the same cluster, as on any shared server: WAL moves, our tables idle."""

    def __init__(self, local_stack: stack.StackConfig, name: str) -> None:
        self.admin_dsn, self.name = local_stack.dsn("postgres"), name
        self.dsn = local_stack.dsn(name)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> OtherDatabase:
        self._admin(f'CREATE DATABASE "{self.name}"')
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE noise (id serial PRIMARY KEY, at timestamptz DEFAULT now())")
        self.thread.start()
        return self

    def _run(self) -> None:
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            while not self.stop_event.wait(0.02):
                cur.execute("INSERT INTO noise DEFAULT VALUES")
        conn.close()

    def _admin(self, statement: str) -> None:
        conn = psycopg2.connect(self.admin_dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(statement)
        conn.close()

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)
        self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


@pytest.mark.slow
def test_capture_stopped_and_started_after_quiet_periods_resumes_every_time(
    local_stack: stack.StackConfig, pg_database: str, capture_factory: Callable[..., Capture], unique_name: str
) -> None:
    """Stops by SIGTERM and kill -9, each a moment after a heartbeat, while only another database writes."""
    conn = psycopg2.connect(pg_database)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE zoo (id int PRIMARY KEY, name text)")
        cur.execute("INSERT INTO zoo VALUES (1, 'first')")
    capture = capture_factory(pg_database, include="public.zoo", heartbeat_interval=3.0)
    rng = random.Random()
    with OtherDatabase(local_stack, f"{unique_name}_other"):
        for i, sig in enumerate([signal.SIGTERM, signal.SIGKILL, signal.SIGTERM, signal.SIGKILL, signal.SIGTERM]):
            process = capture.spawn()
            capture.wait_caught_up(pg_database)
            with conn.cursor() as cur:
                cur.execute("INSERT INTO zoo VALUES (%s, 'row')", (i + 2,))
            capture.wait_caught_up(pg_database)
            time.sleep(rng.uniform(1.5, 2.8))  # quiet here, busy next door: keepalives move the slot
            process.send_signal(sig)
            assert process.wait(timeout=30) == (0 if sig == signal.SIGTERM else -9)
        capture.spawn()
        capture.wait_caught_up(pg_database)
    capture.stop()
    log = capture.log.read_text() if capture.log else ""
    assert "error" not in log.lower() and "Traceback" not in log, log[-3000:]
    state = apply_changes(capture.changes(), Registry(capture.cfg.registry_url))
    assert_table_matches(conn, "zoo", ["id"], state.get("zoo", {}))
    conn.close()


# ---- a snapshot started over -----------------------------------------------------------------
def lock_when_the_slot_exists(conn: Any, slot: str) -> None:
    """Lock ``products`` (held until a rollback) as soon as capture created its slot: its schemas are
    registered next, so the copy has not begun; it will copy the bigger tables and wait for this one."""
    deadline = time.monotonic() + 30
    with conn.cursor() as cur:
        while time.monotonic() < deadline:
            cur.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,))
            if cur.fetchone():
                cur.execute("LOCK TABLE products IN ACCESS EXCLUSIVE MODE")
                return
            conn.rollback()
            time.sleep(0.005)
    raise AssertionError("capture created no slot")


def killed_mid_snapshot(shop_db: Any, capture: Capture) -> list[dict[str, Any]]:
    """2,000 more orders with 2 items each; capture killed mid-snapshot: ``products`` is locked, so the
    snapshot copies the bigger tables (biggest first) and then waits for it."""
    with shop_db, shop_db.cursor() as cur:
        cur.execute("INSERT INTO orders (customer_id, status, total) SELECT (SELECT min(id) FROM customers),"
                    " 'paid', g FROM generate_series(1, 2000) g")  # fmt: skip
        cur.execute("INSERT INTO order_items SELECT o.id, n, (SELECT min(id) FROM products), 1, 1"
                    " FROM orders o, generate_series(1, 2) n WHERE NOT EXISTS"
                    " (SELECT 1 FROM order_items i WHERE i.order_id = o.id)")  # fmt: skip
        cur.execute(f'CREATE PUBLICATION "{capture.cfg.publication}" FOR TABLE customers, products, orders,'
                    " order_items")  # fmt: skip
        cur.execute("SELECT (SELECT count(*) FROM orders) + (SELECT count(*) FROM order_items)")
        wanted = cur.fetchone()[0]
    shop_db.autocommit = True
    with shop_db.cursor() as cur:
        cur.execute("ANALYZE")
    shop_db.autocommit = False
    process = capture.spawn()
    lock_when_the_slot_exists(shop_db, capture.cfg.slot)  # the slot waits for open transactions: not before
    deadline = time.monotonic() + 60
    read: list[dict[str, Any]] = []
    while time.monotonic() < deadline and len(read) < wanted:
        time.sleep(0.2)
        read = [c for c in capture.changes() if c["op"] == "READ" and c["table"] in ("orders", "order_items")]
    process.kill()
    process.wait()
    shop_db.rollback()
    partial = capture.changes()
    assert len(read) == wanted and not any(c["op"] == "SNAPSHOT_END" for c in partial), "not killed mid-snapshot"
    return partial


@pytest.mark.slow
def test_a_snapshot_started_over_retracts_the_rows_deleted_meanwhile(
    local_stack: stack.StackConfig,
    pg_database: str,
    shop_db: Any,
    capture_factory: Callable[..., Capture],
    worker_factory: Callable[..., Worker],
    spark: SparkSession,
    analytics_config: Callable[..., AnalyticsConfig],
) -> None:
    """Kill capture mid-snapshot, delete rows the abandoned snapshot had read, start it again: the raw topic
    applied in order, the table topics, the worker's tables, the view, Redis and Spark equal PostgreSQL."""
    capture = capture_factory(pg_database)
    partial = killed_mid_snapshot(shop_db, capture)
    decode = Registry(capture.cfg.registry_url)
    items = [decode(c["key"]) for c in partial if c["op"] == "READ" and c["table"] == "order_items"]
    orders = sorted({k["order_id"] for k in items})[::150]
    assert len(orders) >= 5, "the abandoned snapshot read too few items to test this"
    with shop_db, shop_db.cursor() as cur:  # gone before the new snapshot: their items go too (cascade)
        cur.execute("DELETE FROM orders WHERE id = ANY(%s)", (orders,))

    capture.spawn()
    capture.wait_caught_up(pg_database, timeout=300)
    changes = check_reconciles(capture, shop_db, committed=0)  # the raw topic applied in order
    end = next(c for c in changes if c["op"] == "SNAPSHOT_END")
    retracted = [c for c in changes if c["op"] == "DELETE" and c["commit_lsn"] == end["commit_lsn"]]
    assert all(c["tx_size"] == 0 and c["_offset"] < end["_offset"] for c in retracted)
    gone_items = {decode(c["key"])["order_id"] for c in retracted if c["table"] == "order_items"}
    gone_orders = {decode(c["key"])["id"] for c in retracted if c["table"] == "orders"}
    assert gone_items == gone_orders == set(orders), "a DELETE for each row the abandoned snapshot had read"
    read_items = [k for k in items if k["order_id"] in set(orders)]
    assert len(retracted) == len(read_items) + len(orders), "no other DELETE"

    worker = worker_factory(capture.cfg.topic_prefix, views=shop.VIEWS_TOML).start()
    reconciled(shop_db, capture, [worker], timeout=120)
    views_reconciled(shop_db, capture, worker, local_stack.redis_url, timeout=120)
    worker.kill(signal.SIGTERM)  # at rest: the cores are Spark's from here
    capture.stop()
    cfg = analytics_config(capture.cfg.topic_prefix)
    for table in shop.TABLES:
        rows = [plain(r) for r in read(spark, cfg, table=table, mode="latest").collect()]
        count, problems = compare(shop_db, table, shop.KEYS[table], dict(enumerate(rows)))
        assert not problems and count == len(rows), "\n".join(problems[:20])


# ---- PostgreSQL restarted under load ---------------------------------------------------------
class Load:
    """Inserts, updates and deletes rows of ``items`` in a thread, reconnecting when the server goes away."""

    def __init__(self, dsn: str, keys: int = 500) -> None:
        self.dsn = dsn
        self.keys = keys  # the writes' keys: 0 to keys - 1
        self.rng = random.Random(7)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.committed = 0

    def start(self) -> Load:
        self.thread.start()
        return self

    def _run(self) -> None:
        conn = None
        while not self.stop_event.wait(0.005):
            try:
                conn = conn if conn is not None and not conn.closed else psycopg2.connect(self.dsn)
                self._step(conn)
            except psycopg2.Error:
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.1)
        if conn is not None:
            conn.close()

    def _step(self, conn: Any) -> None:
        key = self.rng.randrange(self.keys)
        with conn, conn.cursor() as cur:
            cur.execute("INSERT INTO items VALUES (%s, 1, 'n') ON CONFLICT (id) DO UPDATE SET n = items.n + 1", (key,))
            if self.rng.random() < 0.3:
                cur.execute("DELETE FROM items WHERE id = %s", (self.rng.randrange(self.keys),))
        self.committed += 1

    def stop(self) -> int:
        self.stop_event.set()
        self.thread.join(timeout=30)
        return self.committed


def streaming_items(dsn: str, capture_factory: Callable[..., Capture], **settings: Any) -> Capture:
    """A table ``items`` and the real capture streaming it."""
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE items (id int PRIMARY KEY, n int NOT NULL, note text)")
    conn.close()
    capture = capture_factory(dsn, **settings)
    capture.spawn()
    capture.wait_caught_up(dsn)
    return capture


@pytest.mark.slow
def test_postgresql_restarted_under_load_fast_and_immediate_capture_resumes(
    own_postgres: stack.Postgres, capture_factory: Callable[..., Capture]
) -> None:
    dsn = own_postgres.cfg.dsn()
    capture = streaming_items(dsn, capture_factory, on_error="log", heartbeat_interval=0.5)
    load = Load(dsn).start()
    for mode in ("fast", "immediate"):
        time.sleep(2)
        restart_postgres(own_postgres, mode)
    time.sleep(2)
    committed = load.stop()
    capture.wait_caught_up(dsn, timeout=120)
    assert capture.process is not None and capture.process.poll() is None, "capture died"
    capture.stop()
    log = capture.log.read_text() if capture.log else ""
    assert "Traceback" not in log and "lost the PostgreSQL connection" in log, log[-3000:]
    assert log.count("; reconnecting (retrying every") == 2 and log.count("reconnected after") == 2, log[-3000:]
    assert committed > 100
    conn = psycopg2.connect(dsn)
    state = apply_changes(capture.changes(), Registry(capture.cfg.registry_url))
    assert_table_matches(conn, "items", ["id"], state.get("items", {}))
    conn.close()


ROWS, CHUNK = 100_000, 200  # the backfilled table and its chunks: long enough to restart PostgreSQL twice inside


@pytest.mark.slow
def test_postgresql_restarted_twice_during_a_backfill_under_load_the_backfill_goes_on_from_its_last_chunk(
    own_postgres: stack.Postgres, capture_factory: Callable[..., Capture]
) -> None:
    """``headwater snapshot items`` while a writer inserts, updates and deletes keys across the whole table;
    PostgreSQL restarted (fast, then immediate) while the chunks are read: capture reconnects each time, the
    backfill goes on after its last saved chunk (not from the start), and the raw topic ends equal to the table."""
    dsn = own_postgres.cfg.dsn()
    capture = streaming_items(dsn, capture_factory, on_error="log", heartbeat_interval=0.5, backfill_chunk_rows=CHUNK)
    faults = [functools.partial(restart_postgres, own_postgres, mode) for mode in ("fast", "immediate")]
    # what was written since the last save is written again: ~6 chunks a restart on one machine, ~21 in CI (saves
    # come every status interval, so a faster read writes more between two)
    log = backfill_through(dsn, capture, faults, read_again=True)
    assert log.count("reconnected after") >= 2, log[-3000:]


@pytest.mark.slow
def test_the_broker_cut_off_then_paused_during_a_backfill_under_load_the_backfill_waits_and_goes_on(
    pg_database: str, capture_factory: Callable[..., Capture], proxied_broker: ProxiedBroker
) -> None:
    """As above with the broker away instead: every connection to it dropped and refused for 10 s, later the
    broker stopped (SIGSTOP) for 10 s, each while the chunks are written: capture says Kafka does not answer and
    waits, the backfill goes on, nothing is read twice, and the raw topic ends equal to the table."""
    capture = streaming_items(pg_database, capture_factory, bootstrap=proxied_broker.bootstrap, on_error="log",
                              backfill_chunk_rows=CHUNK)  # fmt: skip

    told: list[tuple[bool, bool]] = []  # whether capture's log, and its /ready, said Kafka does not answer

    def logged() -> str:
        return capture.log.read_text() if capture.log else ""

    def away(outage: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        before, ready = len(logged()), False
        with outage():
            entered = time.monotonic()
            time.sleep(5)  # capture says so once Kafka did not answer for 5 s
            while time.monotonic() < entered + 9.5:  # what a user watching /ready sees before the outage ends
                answer = httpx.get(capture.metrics_url + "/ready", timeout=2)
                ready = ready or (answer.status_code == 503 and "does not answer" in answer.json()["reason"])
                time.sleep(0.3)
            told.append(("does not answer" in logged()[before:], ready))
            time.sleep(max(entered + 10 - time.monotonic(), 0))

    log = backfill_through(pg_database, capture, [functools.partial(away, lambda: proxied_broker.cut_off(10)),
                                                  functools.partial(away, proxied_broker.paused)],
                           read_again=False)  # fmt: skip
    assert "reconnecting" not in log, log[-3000:]  # it waited in its session: nothing was read again
    # each outage told while the chunks wait on Kafka, in the log and on /ready
    assert told == [(True, True), (True, True)] and log.count("answers again") >= 2, (told, log[-3000:])


def backfill_through(dsn: str, capture: Capture, faults: list[Callable[[], None]], read_again: bool) -> str:
    """``items`` grown to ``ROWS`` rows, then ``headwater snapshot items`` under a writer of every key, each fault
    run once the backfill saved 10,000 (then 20,000 more) rows, still chunking. Then: no row read twice, or with
    ``read_again`` only rows past where the first fault found it (it went on from a save, it did not start over),
    every row the writer never touched was read (none skipped), and the raw topic equals the table. Capture's
    log."""
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO items SELECT g, 0, repeat('x', 50) FROM generate_series(0, %s) g", (ROWS - 1,))
    conn.close()
    capture.wait_caught_up(dsn, timeout=120)
    load = Load(dsn, keys=ROWS).start()
    try:
        done = _faulted_backfill(capture, faults)
    finally:
        committed = load.stop()
    capture.wait_caught_up(dsn, timeout=180)
    capture.stop()
    log = capture.log.read_text() if capture.log else ""
    assert "Traceback" not in log and committed > 100, log[-3000:]
    changes = capture.changes()
    decode = Registry(capture.cfg.registry_url)
    ids = [decode(c["key"])["id"] for c in changes if c["backfill"] == done.id and c["op"] == "READ"]
    assert_read_again(ids, read_again)
    untouched = {row[0] for row in run(dsn, "SELECT id FROM items WHERE n = 0")}
    assert untouched and not untouched - set(ids), f"{len(untouched - set(ids))} rows never touched were not read"
    conn = psycopg2.connect(dsn)
    state = apply_changes(changes, decode)
    assert_table_matches(conn, "items", ["id"], state.get("items", {}))
    conn.close()
    return log


def assert_read_again(ids: list[int], allowed: bool) -> None:
    """Keys read twice: none, or (``allowed``) only keys past the first half of the 10,000 rows saved before the
    first fault (a start from the beginning reads key 0 again), fewer than the table's rows in all. (How many
    depends on the machine's speed: what was read since the last save, every status interval.)"""
    twice = sorted(key for key, reads in Counter(ids).items() if reads > 1)
    again = len(ids) - len(set(ids))
    assert not twice or allowed, f"{again} rows read again, keys {twice[:5]}..."
    assert not twice or (twice[0] >= 5_000 and again < ROWS), f"{again} rows read again, from key {twice[0]}"


def _faulted_backfill(capture: Capture, faults: list[Callable[[], None]]) -> Backfill:
    """``headwater snapshot items``, each fault run while it chunks; the backfill once done."""
    capture.snapshot("items")
    rows = 10_000
    for fault in faults:
        at = wait_until(capture, functools.partial(_chunking, capture, "public.items", rows), 120)
        assert at.status == "running" and at.phase == "chunks", f"done before the fault: {at.describe()}"
        fault()
        rows = at.rows + 20_000
    done = wait_until(capture, lambda: next((b for b in capture.backfills() if b.status not in UNFINISHED), None), 240)
    assert done.status == "done", done.describe()
    return done


def wait_until(capture: Capture, found: Callable[[], Backfill | None], timeout: float) -> Backfill:
    """``found()`` once it is not None, polled every 50 ms (an AssertionError after ``timeout`` s, or at once if
    capture exited)."""
    deadline = time.monotonic() + timeout
    while (got := found()) is None:
        if capture.process is None or capture.process.poll() is not None:
            raise AssertionError(f"capture exited: {capture.log.read_text()[-3000:] if capture.log else ''}")
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {[b.describe() for b in capture.backfills()]}"
        time.sleep(0.05)
    return got


@pytest.mark.slow
def test_postgresql_stopped_with_on_error_exit_ends_capture_with_one_line(
    own_postgres: stack.Postgres, capture_factory: Callable[..., Capture]
) -> None:
    dsn = own_postgres.cfg.dsn()
    capture = streaming_items(dsn, capture_factory, on_error="exit")
    process = capture.process
    assert process is not None
    restart_postgres(own_postgres, "immediate")
    assert process.wait(timeout=60) == 1
    log = capture.log.read_text() if capture.log else ""
    assert "Traceback" not in log, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("headwater: error:")]
    assert len(errors) == 1 and "lost the PostgreSQL connection" in errors[0], log[-2000:]


# ---- a broker that lost every topic ----------------------------------------------------------
@pytest.mark.slow
def test_a_broker_restarted_without_its_topics_is_named_by_capture_and_the_worker(
    pg_database: str,
    shop_db: Any,
    capture_factory: Callable[..., Capture],
    worker_factory: Callable[..., Worker],
    broker_factory: Callable[[], BrokerProcess], shop_writer: Callable[..., ShopWriter],
) -> None:
    """The local broker keeps topics in memory: a restart empties it. Capture (even with on_error = log)
    and the worker say so and stop; nobody creates the raw topic, nor any other topic of theirs, again through
    auto-create."""
    broker = broker_factory()
    capture = capture_factory(pg_database, bootstrap=broker.bootstrap, on_error="log")
    process = capture.spawn()
    capture.wait_caught_up(pg_database)
    worker = worker_factory(capture.cfg.topic_prefix, bootstrap=broker.bootstrap, broker_profile="tansu").start()
    writer = shop_writer(rate=50)
    time.sleep(2)
    broker.restart()
    assert process.wait(timeout=120) == 1
    assert worker.process is not None and worker.process.wait(timeout=120) != 0
    writer.stop()
    log = capture.log.read_text() if capture.log else ""
    assert "Traceback" not in log, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("headwater: error:")]
    assert len(errors) == 1 and f"the broker no longer has {capture.cfg.changes_topic}" in errors[0], log[-3000:]
    assert f"the broker no longer has {capture.cfg.topic_prefix}." in worker.log.read_text()  # raw or table topic
    topics = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=10).topics
    assert capture.cfg.changes_topic not in topics, "the raw topic was created again by auto-create"
    again = [t for t in topics if t.startswith(f"{capture.cfg.topic_prefix}.")]
    assert not again, f"topics made again on the emptied broker (a write's auto-create): {again}"


@pytest.mark.slow
def test_a_broker_restart_that_keeps_its_data_under_load_capture_reconnects_and_resumes(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], proxied_broker: ProxiedBroker,
    shop_writer: Callable[..., ShopWriter]
) -> None:
    """Every connection to the broker dropped and refused for 8 s (as a real Kafka restarting looks to
    its clients): capture waits, reconnects, and the raw topic reconciles with PostgreSQL."""
    capture = capture_factory(pg_database, bootstrap=proxied_broker.bootstrap, on_error="log")
    process = capture.spawn()
    capture.wait_caught_up(pg_database)
    writer = shop_writer(rate=100)
    time.sleep(2)
    proxied_broker.proxy.outage(8)
    time.sleep(3)
    committed = writer.stop()
    capture.wait_caught_up(pg_database, timeout=180)
    assert process.poll() is None, "capture died"
    capture.stop()
    log = capture.log.read_text() if capture.log else ""
    assert "Traceback" not in log, log[-3000:]
    assert committed > 200
    check_reconciles(capture, shop_db, committed)
