"""Faults: kill -9 of the capture process, a broker that stops answering. Nothing committed is lost."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from capture.state import snapshot_done
from headwater.reconcile import apply_changes, assert_table_matches
from headwater.stack import Broker, StackConfig
from tables.config import Settings
from tables.kafka import read_topic
from tables.registry import Registry
from tables.wire import parse_lsn
from tests.plugins.capture import Capture, ShopWriter

SHOP_KEYS = {"customers": ["id"], "products": ["id"], "orders": ["id"], "order_items": ["order_id", "line_no"]}


def confirmed_lsn(dsn: str, slot: str) -> int:
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        value = cur.fetchone()[0]
    conn.close()
    return parse_lsn(value)


def wait_snapshot(capture: Capture, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c["op"] == "SNAPSHOT_END" for c in capture.changes()):
            return
        time.sleep(0.5)
    raise AssertionError(f"no snapshot end; log: {capture.log.read_text()[-3000:] if capture.log else ''}")


def check_reconciles(capture: Capture, shop_db: Any, committed: int) -> list[dict[str, Any]]:
    changes = capture.changes()
    decode = Registry(capture.cfg.registry_url)
    state = apply_changes(changes, decode)
    for table, key in SHOP_KEYS.items():
        assert_table_matches(shop_db, table, key, state.get(table, {}))
    # a snapshot's own DELETEs (keys an abandoned snapshot left, see capture.retract) have tx_size 0, like READs
    streamed = {c["commit_lsn"] for c in changes if c["op"] in ("INSERT", "UPDATE", "DELETE") and c["tx_size"]}
    assert len(streamed) == committed, f"{committed} transactions committed, {len(streamed)} on the topic"
    by_tx: dict[int, set[int]] = {}
    sizes: dict[int, int] = {}
    for c in changes:
        if c["op"] in ("INSERT", "UPDATE", "DELETE", "TRUNCATE") and c["tx_size"]:
            by_tx.setdefault(c["commit_lsn"], set()).add(c["position"])
            sizes[c["commit_lsn"]] = c["tx_size"]
    assert all(positions == set(range(sizes[lsn])) for lsn, positions in by_tx.items()), "a transaction is partial"
    return changes


@pytest.mark.slow
def test_kill_9_at_random_points_loses_nothing(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], shop_writer: Callable[..., ShopWriter]
) -> None:
    capture = capture_factory(pg_database)
    capture.spawn()
    wait_snapshot(capture)
    writer = shop_writer()
    kills: list[tuple[int, int]] = []  # (topic length at the kill, slot's confirmed LSN at the kill)
    rng = random.Random()
    for _ in range(3):
        time.sleep(rng.uniform(0.5, 2.5))
        assert capture.process is not None
        capture.process.kill()
        capture.process.wait()
        kills.append((len(read_topic(capture.cfg.bootstrap, capture.cfg.changes_topic)),
                      confirmed_lsn(pg_database, capture.cfg.slot)))  # fmt: skip
        capture.spawn()
    time.sleep(1.5)
    committed = writer.stop()
    capture.wait_caught_up(pg_database)
    capture.stop()

    changes = check_reconciles(capture, shop_db, committed)
    assert committed > 100
    seen: set[tuple[int, int]] = set()
    boundaries = [offset for offset, _ in kills] + [len(changes) + 1]
    for index, change in enumerate(changes):
        ident = (change["commit_lsn"], change["position"])
        if ident in seen:
            # a duplicate: only changes at or after the commit last confirmed before the restart
            kill = max(i for i, b in enumerate(boundaries) if b <= index)
            assert change["commit_lsn"] >= kills[kill][1], f"replayed a confirmed change at offset {index}"
        seen.add(ident)


@pytest.mark.slow
def test_broker_paused_30s_under_load_then_recovers(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], local_stack: StackConfig,
    shop_writer: Callable[..., ShopWriter]
) -> None:
    capture = capture_factory(pg_database, on_error="log").start()
    wait_snapshot(capture)
    writer = shop_writer(rate=100)
    time.sleep(2)
    broker_pid = Broker(local_stack).pid()
    assert broker_pid is not None
    os.kill(broker_pid, signal.SIGSTOP)  # the broker stops answering; its in-memory log survives
    try:
        time.sleep(30)
    finally:
        os.kill(broker_pid, signal.SIGCONT)
    time.sleep(2)
    committed = writer.stop()
    capture.wait_caught_up(pg_database, timeout=180)
    capture.stop()
    check_reconciles(capture, shop_db, committed)


@pytest.mark.slow
def test_on_error_exit_ends_non_zero_when_kafka_stops_answering(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture], local_stack: StackConfig,
    shop_writer: Callable[..., ShopWriter]
) -> None:
    capture = capture_factory(pg_database)
    process = capture.spawn("--producer", "message.timeout.ms=4000")
    wait_snapshot(capture)
    writer = shop_writer(rate=50)
    broker_pid = Broker(local_stack).pid()
    assert broker_pid is not None
    os.kill(broker_pid, signal.SIGSTOP)
    try:
        code = process.wait(timeout=60)
    finally:
        os.kill(broker_pid, signal.SIGCONT)
        writer.stop()
    assert code == 1
    assert capture.log is not None
    log = capture.log.read_text()
    assert "headwater: error:" in log and "timed out" in log.lower()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (snapshot workers are forked: their command line is capture's)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(proc.name))
    return found


def running(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def copying(capture: Capture) -> bool:
    """The snapshot's progress (in the state file) shows rows copied and not all done."""
    path = capture.cfg.state_dir / f"{capture.cfg.slot}.sqlite"
    if not path.exists():
        return False
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT sum(rows_done), min(done) FROM progress").fetchone()
    except sqlite3.OperationalError:
        return False
    finally:
        db.close()
    return bool(rows and rows[0] and rows[0] >= 60_000 and rows[1] == 0)


# The snapshot copies 260,000 rows in about a second: a small local queue (most of each batch of
# 5,000 then goes through the queue-full path) and a longer linger make it last several seconds.
PACED = Settings({"queue.buffering.max.messages": "1000", "linger.ms": "50"})


def spawn_into_a_long_snapshot(shop_db: Any, capture: Capture) -> Any:
    """260,000 more orders (above the size for worker processes); returns the process once it copies."""
    with shop_db, shop_db.cursor() as cur:
        cur.execute(
            "INSERT INTO orders (customer_id, status, total, note) SELECT c.id, 'paid', g, 'n' || g"
            " FROM generate_series(1, 260000) g, LATERAL (SELECT min(id) AS id FROM customers) c"
        )
        cur.execute("ANALYZE")
    process = capture.spawn()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not copying(capture):
        time.sleep(0.1)
    return process


@pytest.mark.slow
def test_snapshot_killed_midway_restarts_cleanly(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture]
) -> None:
    capture = capture_factory(pg_database, producer=PACED)
    process = spawn_into_a_long_snapshot(shop_db, capture)
    workers = children(process.pid)
    assert len(workers) == 2, "the snapshot is copied by two worker processes"
    process.kill()
    process.wait()
    partial = capture.changes()
    assert partial and not any(c["op"] == "SNAPSHOT_END" for c in partial), "killed too late to test this"
    time.sleep(2)
    assert not [w for w in workers if running(w)], "snapshot workers outlived the killed capture"

    capture.spawn()
    capture.wait_caught_up(pg_database, timeout=300)
    capture.stop()
    changes = capture.changes()
    ends = [c for c in changes if c["op"] == "SNAPSHOT_END"]
    assert len(ends) == 1, "exactly one complete snapshot"
    complete = [c for c in changes if c["op"] == "READ" and c["commit_lsn"] == ends[0]["commit_lsn"]]
    abandoned = [c for c in changes if c["op"] == "READ" and c["commit_lsn"] != ends[0]["commit_lsn"]]
    assert len(complete) == ends[0]["tx_size"] and abandoned, "the abandoned rows carry the old consistent point"
    assert all(c["_offset"] < ends[0]["_offset"] for c in complete)
    check_reconciles(capture, shop_db, committed=0)


@pytest.mark.slow
def test_sigterm_to_capture_and_its_workers_during_snapshot_stops_promptly(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture]
) -> None:
    capture = capture_factory(pg_database, producer=PACED)
    process = spawn_into_a_long_snapshot(shop_db, capture)
    c = capture.cfg
    status = subprocess.run(
        [sys.executable, "-m", "headwater.cli", "status", "--slot", c.slot, "--state-dir", str(c.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HEADWATER_CAPTURE_DSN": c.dsn.reveal()},
    )
    assert "snapshot: in progress or interrupted" in status.stdout
    assert re.search(r"public\.orders: \d+/\d+ rows", status.stdout), status.stdout
    workers = children(process.pid)
    os.kill(process.pid, signal.SIGTERM)  # a service manager's stop: SIGTERM to every process of the unit
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):  # capture may have stopped it already, as systemd allows
            os.kill(pid, signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    assert capture.log is not None and "stopped during the snapshot" in capture.log.read_text()
    assert not snapshot_done(capture.cfg.state_dir, capture.cfg.slot)
    assert not any(c["op"] == "SNAPSHOT_END" for c in capture.changes())
    assert len(workers) == 2 and not [w for w in workers if running(w)], "a snapshot worker outlived capture"


@pytest.mark.slow
def test_ctrl_c_during_snapshot_stops_capture_and_its_workers(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture]
) -> None:
    """Ctrl-C signals every process of the terminal's group: the forked workers inherit capture's
    handlers, so they must leave SIGINT to capture, which stops the snapshot and then them."""
    capture = capture_factory(pg_database, producer=PACED)
    process = spawn_into_a_long_snapshot(shop_db, capture)
    workers = children(process.pid)
    assert len(workers) == 2, "the snapshot is copied by two worker processes"
    for pid in (process.pid, *workers):
        os.kill(pid, signal.SIGINT)
    assert process.wait(timeout=20) == 0
    assert capture.log is not None and "stopped during the snapshot" in capture.log.read_text()
    assert not [w for w in workers if running(w)], "a snapshot worker outlived capture"
    assert not snapshot_done(capture.cfg.state_dir, capture.cfg.slot)
    copied = len(read_topic(capture.cfg.bootstrap, capture.cfg.changes_topic))
    assert copied < 260_000, "the workers went on copying after capture was stopped"


def test_workers_started_for_a_small_snapshot_do_not_linger(
    pg_database: str, shop_db: Any, capture_factory: Callable[..., Capture]
) -> None:
    """Workers are forked before capture knows the snapshot's size; a small one is copied in capture
    itself, and the workers are stopped, not left beside the stream."""
    capture = capture_factory(pg_database)
    process = capture.spawn()
    capture.wait_caught_up(pg_database)
    assert snapshot_done(capture.cfg.state_dir, capture.cfg.slot)
    assert process.poll() is None and children(process.pid) == []
    ends = [c for c in capture.changes() if c["op"] == "SNAPSHOT_END"]
    assert len(ends) == 1 and ends[0]["tx_size"] > 0
