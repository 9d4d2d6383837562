"""A 1,000,000-row transaction streams through capture with bounded memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psycopg2
import pytest

from tests.plugins.capture import Capture

ROWS = 1_000_000


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow
def test_million_row_transaction_streams_in_bounded_memory(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE big (id int PRIMARY KEY, pad text)")
    capture = capture_factory(pg_database, status_interval=1.0)
    process = capture.spawn()
    capture.wait_caught_up(pg_database)
    with conn, conn.cursor() as cur:  # one transaction
        cur.execute("INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, %s) g", (ROWS,))
    conn.close()
    capture.wait_caught_up(pg_database, timeout=900)
    peak = peak_rss_mb(process.pid)
    capture.stop()

    positions = bytearray(ROWS)
    inserts = 0
    for change in capture.changes():
        if change["op"] == "INSERT":
            assert change["tx_size"] == ROWS
            positions[change["position"]] = 1
            inserts += 1
    assert inserts == ROWS and all(positions), "every row of the transaction arrives once, in its position"
    assert peak < 300, f"capture peaked at {peak:.0f} MB"
