"""The capture agent's local state: checkpoint, snapshot progress and the TOAST cache (SQLite).

Promise: one SQLite file per slot. ``checkpoint`` commits the confirmed LSN together
with the TOAST cache writes made up to it, in one transaction, *before* the slot is
told (so a crash replays, never skips). The TOAST cache keeps the last values of
large columns per row key with the commit LSN that wrote them, so an update that
leaves a TOASTed column alone can carry its real value; versions older than the
newest one at or below the confirmed LSN are pruned.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoint (
    slot TEXT PRIMARY KEY,
    consistent_point INTEGER NOT NULL,
    snapshot_done INTEGER NOT NULL,
    confirmed_lsn INTEGER NOT NULL,
    last_commit_lsn INTEGER NOT NULL DEFAULT 0,
    last_commit_time INTEGER NOT NULL DEFAULT 0,
    events INTEGER NOT NULL DEFAULT 0,
    rate REAL NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS toast (
    tbl TEXT NOT NULL, key BLOB NOT NULL, col INTEGER NOT NULL, lsn INTEGER NOT NULL, value TEXT NOT NULL,
    PRIMARY KEY (tbl, key, col, lsn)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS progress (
    tbl TEXT PRIMARY KEY, rows_done INTEGER NOT NULL, rows_estimate INTEGER NOT NULL, done INTEGER NOT NULL
);
"""


@dataclass(frozen=True)
class Checkpoint:
    slot: str
    consistent_point: int
    snapshot_done: bool
    confirmed_lsn: int
    last_commit_lsn: int
    last_commit_time: int
    events: int
    rate: float
    updated_at: float


class State:
    def __init__(self, directory: Path, slot: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{slot}.sqlite"
        self.slot = slot
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level="DEFERRED")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    def load(self) -> Checkpoint | None:
        row = self.db.execute("SELECT * FROM checkpoint WHERE slot = ?", (self.slot,)).fetchone()
        return Checkpoint(*row) if row else None

    def start_snapshot(self, consistent_point: int, *, done: bool) -> None:
        """A new slot: forget everything else and record its consistent point."""
        with self.db:
            self.db.execute("DELETE FROM checkpoint WHERE slot = ?", (self.slot,))
            self.db.execute("DELETE FROM toast")
            self.db.execute("DELETE FROM progress")
            self.db.execute(
                "INSERT INTO checkpoint (slot, consistent_point, snapshot_done, confirmed_lsn, updated_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (self.slot, consistent_point, int(done), consistent_point, time.time()),
            )

    def finish_snapshot(self) -> None:
        with self.db:
            self.db.execute(
                "UPDATE checkpoint SET snapshot_done = 1, updated_at = ? WHERE slot = ?", (time.time(), self.slot)
            )

    def progress(self, table: str, done: int, estimate: int, finished: bool) -> None:
        with self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO progress VALUES (?, ?, ?, ?)", (table, done, estimate, int(finished))
            )

    def snapshot_progress(self) -> list[tuple[str, int, int, bool]]:
        return [(t, d, e, bool(f)) for t, d, e, f in self.db.execute("SELECT * FROM progress ORDER BY tbl")]

    # ---- TOAST cache ------------------------------------------------------------------------
    def remember(self, table: str, key: bytes, col: int, lsn: int, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO toast VALUES (?, ?, ?, ?, ?)", (table, key, col, lsn, value))

    def recall(self, table: str, key: bytes, col: int, lsn: int) -> str | None:
        row = self.db.execute(
            "SELECT value FROM toast WHERE tbl = ? AND key = ? AND col = ? AND lsn <= ? ORDER BY lsn DESC LIMIT 1",
            (table, key, col, lsn),
        ).fetchone()
        return row[0] if row else None

    def checkpoint(
        self, confirmed_lsn: int, last_commit_lsn: int, last_commit_time: int, events: int, rate: float
    ) -> None:
        """Commit the TOAST cache and the confirmed LSN together (before the slot hears of it)."""
        self.db.execute(
            "UPDATE checkpoint SET confirmed_lsn = max(confirmed_lsn, ?), last_commit_lsn = ?, last_commit_time = ?,"
            " events = ?, rate = ?, updated_at = ? WHERE slot = ?",
            (confirmed_lsn, last_commit_lsn, last_commit_time, events, rate, time.time(), self.slot),
        )
        self.db.commit()

    def prune(self, confirmed_lsn: int) -> None:
        """Drop cached versions no replay from ``confirmed_lsn`` can need."""
        with self.db:
            self.db.execute(
                "DELETE FROM toast WHERE lsn < (SELECT max(t2.lsn) FROM toast t2 WHERE t2.tbl = toast.tbl"
                " AND t2.key = toast.key AND t2.col = toast.col AND t2.lsn <= ?)",
                (confirmed_lsn,),
            )


def snapshot_done(directory: Path, slot: str) -> bool:
    """True once the snapshot of ``slot`` was acknowledged by Kafka (readable while capture runs)."""
    if not (directory / f"{slot}.sqlite").exists():
        return False
    state = State(directory, slot)
    try:
        checkpoint = state.load()
    finally:
        state.close()
    return checkpoint is not None and checkpoint.snapshot_done
