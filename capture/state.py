"""The capture agent's local state: checkpoint, snapshot progress and the TOAST cache (SQLite).

Promise: one SQLite file per slot, readable by its owner only (the TOAST cache holds
table data). ``checkpoint`` commits the confirmed LSN together with the TOAST cache
writes made up to it, in one transaction, *before* the slot is told (so a crash
replays, never skips), and whether capture was *settled* then: every message it had
received was confirmed, so the server may move the slot further on its own keepalives
(see ``stream.Loop``) — the one way a slot may be ahead of its checkpoint. The TOAST cache keeps the last values of
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
    updated_at REAL NOT NULL,
    settled INTEGER NOT NULL DEFAULT 0
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
    settled: bool = False


class State:
    def __init__(self, directory: Path, slot: str) -> None:
        private_dir(directory)
        self.path = directory / f"{slot}.sqlite"
        self.slot = slot
        self.path.touch(mode=0o600, exist_ok=True)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level="DEFERRED")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(checkpoint)")}
        if "settled" not in columns:  # a state file written before the column existed
            self.db.execute("ALTER TABLE checkpoint ADD COLUMN settled INTEGER NOT NULL DEFAULT 0")
        self.db.commit()
        for path in directory.glob(f"{slot}.sqlite*"):  # the -wal and -shm files hold table data too
            path.chmod(0o600)

    def close(self) -> None:
        self.db.close()

    def load(self) -> Checkpoint | None:
        row = self.db.execute(
            "SELECT slot, consistent_point, snapshot_done, confirmed_lsn, last_commit_lsn, last_commit_time, events,"
            " rate, updated_at, settled FROM checkpoint WHERE slot = ?",
            (self.slot,),
        ).fetchone()
        if row is None:
            return None
        slot, point, done, confirmed, commit_lsn, commit_time, events, rate, updated, settled = row
        return Checkpoint(slot, point, bool(done), confirmed, commit_lsn, commit_time, events, rate, updated,
                          bool(settled))  # fmt: skip

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
        self,
        confirmed_lsn: int,
        last_commit_lsn: int,
        last_commit_time: int,
        events: int,
        rate: float,
        *,
        settled: bool = False,
    ) -> None:
        """Commit the TOAST cache and the confirmed LSN together (before the slot hears of it)."""
        self.db.execute(
            "UPDATE checkpoint SET confirmed_lsn = max(confirmed_lsn, ?), last_commit_lsn = ?, last_commit_time = ?,"
            " events = ?, rate = ?, updated_at = ?, settled = ? WHERE slot = ?",
            (confirmed_lsn, last_commit_lsn, last_commit_time, events, rate, time.time(), int(settled), self.slot),
        )
        self.db.commit()

    def advance(self, confirmed_lsn: int) -> None:
        """The slot was found ahead of a settled checkpoint: take its position (see ``stream.Loop``)."""
        with self.db:
            self.db.execute(
                "UPDATE checkpoint SET confirmed_lsn = max(confirmed_lsn, ?), updated_at = ? WHERE slot = ?",
                (confirmed_lsn, time.time(), self.slot),
            )

    def prune(self, confirmed_lsn: int) -> None:
        """Drop cached versions no replay from ``confirmed_lsn`` can need."""
        with self.db:
            self.db.execute(
                "DELETE FROM toast WHERE lsn < (SELECT max(t2.lsn) FROM toast t2 WHERE t2.tbl = toast.tbl"
                " AND t2.key = toast.key AND t2.col = toast.col AND t2.lsn <= ?)",
                (confirmed_lsn,),
            )


def private_dir(directory: Path) -> None:
    """Create ``directory`` (and its missing parents) readable by its owner only; tighten an existing one."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)


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
