"""The capture agent's local state: checkpoint, snapshot progress, the TOAST cache and backfills (SQLite).

Promise: one SQLite file per slot, readable by its owner only (the TOAST cache holds
table data). ``checkpoint`` commits the confirmed LSN together with the TOAST cache
writes made up to it, in one transaction, *before* the slot is told (so a crash
replays, never skips), and whether capture was *settled* then: every message it had
received was confirmed, so the server may move the slot further on its own keepalives
(see ``stream.Loop``) — the one way a slot may be ahead of its checkpoint. The TOAST cache keeps the last values of
large columns per row key with the commit LSN that wrote them, so an update that
leaves a TOASTed column alone can carry its real value; versions older than the
newest one at or below the confirmed LSN are pruned. Backfills (``capture.backfill``) keep
here the tables whose rows the raw topic carries (``captured``: a table that joins them is
backfilled), each backfill with the last chunk Kafka acknowledged (so a restart goes on from
it), the raw topic's end its retraction reads keys up to and whether every chunk it wrote vouched for its
keys (``unvouch``, which commits at once, synced), the requests ``headwater snapshot``
leaves for the running capture with their outcome, and the commit LSN of the last signal-table
row applied (a replay does not apply it twice). The backfill methods do not commit: callers
group them in ``with state.db:``. A file an earlier version wrote gains the columns added since
(``ADDED_COLUMNS``) when it is opened. The requests themselves travel through a ``Mailbox`` of
their own (each write commits at once).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.backfill import UNFINISHED, Backfill, Request

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
CREATE TABLE IF NOT EXISTS captured (tbl TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS backfills (
    id INTEGER PRIMARY KEY AUTOINCREMENT, tbl TEXT NOT NULL, predicate TEXT, origin TEXT NOT NULL,
    status TEXT NOT NULL, phase TEXT NOT NULL, cursor TEXT, upto TEXT, rows_done INTEGER NOT NULL,
    rows_estimate INTEGER NOT NULL, retracted INTEGER NOT NULL, message TEXT NOT NULL, created_at REAL NOT NULL,
    started_at REAL, finished_at REAL, rate REAL NOT NULL DEFAULT 0, updated_at REAL NOT NULL DEFAULT 0,
    dropped INTEGER NOT NULL DEFAULT 0, keys_end INTEGER, vouched INTEGER
);
CREATE TABLE IF NOT EXISTS signals (slot TEXT PRIMARY KEY, lsn INTEGER NOT NULL, idx INTEGER NOT NULL);
"""
REQUESTS = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT, action TEXT NOT NULL, tables TEXT NOT NULL, predicate TEXT,
    origin TEXT NOT NULL, made_at REAL NOT NULL, handled_at REAL, outcome TEXT
);
"""
BACKFILL_COLUMNS = ("id, tbl, predicate, origin, status, phase, cursor, upto, rows_done, rows_estimate, retracted,"
                    " message, dropped, created_at, started_at, finished_at, keys_end, vouched")  # fmt: skip
ADDED_COLUMNS = (  # columns later versions added: (table, column, declaration), added to a state file without them
    ("checkpoint", "settled", "INTEGER NOT NULL DEFAULT 0"),
    ("backfills", "dropped", "INTEGER NOT NULL DEFAULT 0"),
    ("backfills", "keys_end", "INTEGER"),
    ("backfills", "vouched", "INTEGER"),
)


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
        with _closed_on_error(self.db):
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
            _add_columns(self.db)
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

    def start_snapshot(self, consistent_point: int, *, done: bool, tables: tuple[str, ...] = ()) -> None:
        """A new slot: forget everything else and record its consistent point and the ``tables`` it captures
        (the snapshot copies them; their backfills are moot)."""
        with self.db:
            self.db.execute("DELETE FROM checkpoint WHERE slot = ?", (self.slot,))
            for table in ("toast", "progress", "captured", "backfills", "signals"):
                self.db.execute(f"DELETE FROM {table}")  # noqa: S608 - our own table names
            self.db.executemany("INSERT INTO captured VALUES (?)", [(t,) for t in tables])
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

    # ---- backfills (callers commit: ``with state.db:``) ------------------------------------
    def captured(self) -> set[str]:
        return {t for (t,) in self.db.execute("SELECT tbl FROM captured")}

    def capture(self, add: Iterable[str] = (), remove: Iterable[str] = ()) -> None:
        self.db.executemany("INSERT OR IGNORE INTO captured VALUES (?)", [(t,) for t in sorted(add)])
        self.db.executemany("DELETE FROM captured WHERE tbl = ?", [(t,) for t in sorted(remove)])

    def add_backfill(self, table: str, predicate: str | None, origin: str) -> Backfill:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO backfills (tbl, predicate, origin, status, phase, rows_done, rows_estimate, retracted,"
            " message, created_at, updated_at) VALUES (?, ?, ?, 'queued', 'chunks', 0, 0, 0, '', ?, ?)",
            (table, predicate, origin, now, now),
        )
        return Backfill(int(cur.lastrowid or 0), table, predicate, origin, created_at=now)

    def backfills(self, *, unfinished: bool = False, limit: int = 1000, table: str | None = None) -> list[Backfill]:
        """Backfills in the order they were asked for (only those not finished, or the ``limit`` newest; every one of
        ``table`` when it is given)."""
        where = [f"status IN ({', '.join('?' * len(UNFINISHED))})"] if unfinished else []
        where += ["tbl = ?"] if table is not None else []
        rows = self.db.execute(
            f"SELECT {BACKFILL_COLUMNS} FROM backfills {'WHERE ' + ' AND '.join(where) if where else ''}"  # noqa: S608
            " ORDER BY id DESC LIMIT ?",  # fixed text, values bound
            (*(UNFINISHED if unfinished else ()), *((table,) if table is not None else ()),
             -1 if table is not None else limit),
        ).fetchall()
        return [_backfill(row) for row in reversed(rows)]

    def save_backfill(self, b: Backfill, rate: float = 0.0) -> None:
        """``b`` as it is (``vouched`` never goes back from false: a copy saved once acknowledged may predate
        ``unvouch``)."""
        self.db.execute(
            "UPDATE backfills SET status = ?, phase = ?, cursor = ?, upto = ?, rows_done = ?, rows_estimate = ?,"
            " retracted = ?, message = ?, dropped = ?, started_at = ?, finished_at = ?, rate = ?, updated_at = ?,"
            " keys_end = ?, vouched = CASE WHEN vouched = 0 THEN 0 ELSE ? END WHERE id = ?",
            (b.status, b.phase, _json(b.cursor), _json(b.upto), b.rows, b.estimate, b.retracted, b.message,
             b.dropped, b.started_at, b.finished_at, rate, time.time(), b.keys_end, b.vouched, b.id),
        )  # fmt: skip

    def unvouch(self, backfill: int) -> None:
        """A chunk of ``backfill`` did not vouch for its keys: committed before its rows are written, with the WAL
        synced (``synchronous=FULL``: a power loss may roll back a ``NORMAL`` commit while Kafka keeps the rows), so
        a restart never takes the keys of rows on the topic for vouched ones (``Backfill.vouched``). Whatever the
        connection had open is committed first, as ``checkpoint`` would."""
        self.db.commit()
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            with self.db:
                self.db.execute("UPDATE backfills SET vouched = 0 WHERE id = ?", (backfill,))
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")

    def backfill_rates(self) -> dict[int, float]:
        """The rate each backfill had when capture last saved it (rows/s), for ``headwater status``."""
        return dict(self.db.execute("SELECT id, rate FROM backfills WHERE status = 'running'").fetchall())

    def signal_position(self) -> tuple[int, int]:
        """(commit LSN, place among that commit's signals) of the last signal-table row applied."""
        row = self.db.execute("SELECT lsn, idx FROM signals WHERE slot = ?", (self.slot,)).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, -1)

    def signal_applied(self, lsn: int, index: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO signals VALUES (?, ?, ?)", (self.slot, lsn, index))

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


class Mailbox:
    """Requests for the running capture and what it made of them, in a file of their own
    (``<slot>.requests.sqlite``, owner only): ``headwater snapshot`` writes there without waiting for the
    state file, whose TOAST cache keeps a write open between checkpoints while large values stream."""

    def __init__(self, directory: Path, slot: str) -> None:
        private_dir(directory)
        self.path = directory / f"{slot}.requests.sqlite"
        self.path.touch(mode=0o600, exist_ok=True)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        with _closed_on_error(self.db):
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.executescript(REQUESTS)
        for path in directory.glob(f"{slot}.requests.sqlite*"):
            path.chmod(0o600)

    def close(self) -> None:
        self.db.close()

    def request(self, action: str, tables: Sequence[str], predicate: str | None, origin: str = "cli",
                outcome: str | None = None) -> int:  # fmt: skip
        """A request for the running capture (``outcome`` given: one it already handled, e.g. a signal)."""
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO requests (action, tables, predicate, origin, made_at, handled_at, outcome)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (action, json.dumps(list(tables)), predicate, origin, now, now if outcome is not None else None, outcome),
        )
        return int(cur.lastrowid or 0)

    def pending_requests(self) -> list[tuple[int, Request | str]]:
        """Requests not handled yet, oldest first: (id, the request, or why it cannot be read)."""
        rows = self.db.execute(
            "SELECT id, action, tables, predicate FROM requests WHERE handled_at IS NULL ORDER BY id"
        ).fetchall()
        out: list[tuple[int, Request | str]] = []
        for rid, action, tables, predicate in rows:
            try:
                out.append((rid, Request(action, tuple(json.loads(tables)), predicate)))
            except ValueError as exc:
                out.append((rid, str(exc)))
        return out

    def requests(self, limit: int = 10) -> list[tuple[int, str, list[str], str | None, str, str | None]]:
        """The ``limit`` newest requests, oldest first: (id, action, tables, predicate, origin, outcome or None)."""
        rows = self.db.execute(
            "SELECT id, action, tables, predicate, origin, outcome FROM requests ORDER BY id DESC LIMIT ?", (limit,)
        ).fetchall()
        return [(rid, action, json.loads(tables), predicate, origin, outcome)
                for rid, action, tables, predicate, origin, outcome in reversed(rows)]  # fmt: skip

    def handled(self, request_id: int, outcome: str) -> None:
        self.db.execute("UPDATE requests SET handled_at = ?, outcome = ? WHERE id = ?",
                        (time.time(), outcome, request_id))  # fmt: skip

    def outcome(self, request_id: int) -> str | None:
        row = self.db.execute("SELECT outcome FROM requests WHERE id = ?", (request_id,)).fetchone()
        return row[0] if row else None


def _json(value: list[str | None] | None) -> str | None:
    return None if value is None else json.dumps(value)


def _backfill(row: Any) -> Backfill:
    (bid, table, predicate, origin, status, phase, cursor, upto, rows, estimate, retracted, message, dropped,
     created, started, finished, keys_end, vouched) = row  # fmt: skip
    return Backfill(bid, table, predicate, origin, status, phase, json.loads(cursor) if cursor else None,
                    json.loads(upto) if upto else None, rows, estimate, retracted, message, dropped, created, started,
                    finished, keys_end, None if vouched is None else bool(vouched))  # fmt: skip


def _add_columns(db: sqlite3.Connection) -> None:
    """The ``ADDED_COLUMNS`` a state file written by an earlier version lacks."""
    for table, column, declaration in ADDED_COLUMNS:
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            try:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
            except sqlite3.OperationalError as exc:  # another process (``headwater status``) added it meanwhile
                if "duplicate column" not in str(exc):
                    raise


@contextlib.contextmanager
def _closed_on_error(db: sqlite3.Connection) -> Iterator[None]:
    """Set-up of a new connection: closed if it fails (a file locked or unreadable), never left to the collector."""
    try:
        yield
    except BaseException:
        db.close()
        raise


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
