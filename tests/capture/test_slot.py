"""The slot and the checkpoint: what ``headwater status`` shows, and lost or mismatched slots."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import psycopg2
import pytest

from capture.errors import CheckpointMismatchError, SlotLostError
from tests.plugins.capture import Capture


def make_table(dsn: str) -> None:
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        cur.execute("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 10) g")
    conn.close()


def streamed(dsn: str, capture_factory: Callable[..., Capture]) -> Capture:
    """A capture that took its snapshot of a small table, streamed, and stopped."""
    make_table(dsn)
    capture = capture_factory(dsn).start()
    capture.wait_caught_up(dsn)
    capture.stop()
    return capture


def admin(dsn: str) -> psycopg2.extensions.connection:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    return conn


def test_status_shows_slot_lag_and_last_commit(pg_database: str, capture_factory: Callable[..., Capture]) -> None:
    make_table(pg_database)
    capture = capture_factory(pg_database)
    capture.start()
    capture.wait_caught_up(pg_database)
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("UPDATE t SET v = 'w'")
    conn.close()
    capture.wait_caught_up(pg_database)
    c = capture.cfg
    result = subprocess.run(
        [sys.executable, "-m", "headwater.cli", "status", "--slot", c.slot, "--state-dir", str(c.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HEADWATER_CAPTURE_DSN": c.dsn.reveal()},
    )
    capture.stop()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"slot {c.slot}: active" in out and "wal_status reserved" in out
    assert "confirmed LSN" in out and "WAL retained behind the slot" in out and "lag:" in out
    assert "last commit captured" in out and "s ago" in out
    assert "events: 20 since start" in out  # the 10 snapshot rows, then the update of all 10
    assert "snapshot: done" in out


def test_dropped_slot_is_reported_not_skipped(pg_database: str, capture_factory: Callable[..., Capture]) -> None:
    capture = streamed(pg_database, capture_factory)
    conn = admin(pg_database)
    with conn.cursor() as cur:
        cur.execute("SELECT pg_drop_replication_slot(%s)", (capture.cfg.slot,))
    conn.close()
    error = capture.failure()
    assert isinstance(error, SlotLostError)
    assert "no longer exists" in str(error) and "fresh snapshot" in str(error)


def test_slot_without_checkpoint_is_a_mismatch(
    pg_database: str, capture_factory: Callable[..., Capture], tmp_path
) -> None:
    streamed(pg_database, capture_factory)
    error = capture_factory(pg_database, state_dir=tmp_path / "elsewhere").failure()
    assert isinstance(error, CheckpointMismatchError) and "holds no checkpoint" in str(error)


@pytest.mark.slow
def test_invalidated_slot_is_detected(pg_database: str, capture_factory: Callable[..., Capture]) -> None:
    capture = streamed(pg_database, capture_factory)
    conn = admin(pg_database)
    with conn.cursor() as cur:
        cur.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        cur.execute("SELECT pg_reload_conf()")
        try:
            deadline = time.monotonic() + 60
            status = None
            while time.monotonic() < deadline and status != "lost":
                cur.execute("CREATE TEMP TABLE IF NOT EXISTS filler (x text)")
                cur.execute("INSERT INTO filler SELECT repeat('x', 2000) FROM generate_series(1, 2000)")
                cur.execute("SELECT pg_switch_wal(); CHECKPOINT")
                cur.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (capture.cfg.slot,))
                status = cur.fetchone()[0]
        finally:
            cur.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
            cur.execute("SELECT pg_reload_conf()")
    conn.close()
    assert status == "lost"
    error = capture.failure()
    assert isinstance(error, SlotLostError) and "wal_status = lost" in str(error)
