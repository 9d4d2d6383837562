"""The replication slot: inspect it, create it with an exported snapshot, drop it, report on it.

Promise: ``inspect`` turns every unusable slot state into an error with the way out —
another plugin or database, invalidated (``wal_status = lost``), in use by another
process. ``create`` returns the consistent point and the exported snapshot name; the
replication connection must stay idle until the snapshot has been imported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psycopg2

from capture.catalog import Connection
from capture.errors import SlotLostError, SourceError
from capture.state import snapshot_done
from tables.errors import FatalError
from tables.wire import parse_lsn


@dataclass(frozen=True)
class SlotInfo:
    name: str
    plugin: str
    database: str
    active_pid: int | None
    restart_lsn: int | None
    confirmed_lsn: int | None
    wal_status: str | None
    current_lsn: int

    @property
    def lag_bytes(self) -> int:
        return max(self.current_lsn - (self.confirmed_lsn or self.current_lsn), 0)

    @property
    def retained_bytes(self) -> int:
        return max(self.current_lsn - (self.restart_lsn or self.current_lsn), 0)


SLOT_SQL = """
SELECT slot_name, plugin, database, active_pid, restart_lsn::text, confirmed_flush_lsn::text, wal_status,
       pg_current_wal_lsn()::text
FROM pg_replication_slots WHERE slot_name = %s
"""


def _lsn(text: str | None) -> int | None:
    return parse_lsn(text) if text else None


def find(conn: Connection, slot: str) -> SlotInfo | None:
    with conn.cursor() as cur:
        cur.execute(SLOT_SQL, (slot,))
        row = cur.fetchone()
    conn.commit()
    if row is None:
        return None
    name, plugin, database, pid, restart, confirmed, wal_status, current = row
    return SlotInfo(name, plugin, database, pid, _lsn(restart), _lsn(confirmed), wal_status, parse_lsn(current))


def released(conn: Connection, slot: str, wait: float) -> SlotInfo | None:
    """The slot once no process holds it, waiting up to ``wait`` s (still held after that: as found)."""
    info = find(conn, slot)
    deadline = time.monotonic() + wait
    while info is not None and info.active_pid is not None and time.monotonic() < deadline:
        time.sleep(0.1)
        info = find(conn, slot)
    return info


def inspect(conn: Connection, slot: str, *, release_wait: float = 15.0) -> SlotInfo | None:
    """The slot if it exists and capture can use it; an error naming the problem otherwise.

    A slot still held by a consumer that just died is waited for (``release_wait`` s):
    PostgreSQL frees it once it notices the connection is gone.
    """
    info = released(conn, slot, release_wait)
    if info is None:
        return None
    with conn.cursor() as cur:
        cur.execute("SELECT current_database()")
        database = cur.fetchone()[0]  # type: ignore[index]
    conn.commit()
    if info.plugin != "pgoutput" or info.database != database:
        raise SourceError(
            f"slot '{slot}' belongs to plugin {info.plugin} in database {info.database}, not pgoutput in {database}",
            hint="choose another slot name with [capture] slot",
        )
    if info.wal_status == "lost":
        raise SlotLostError(slot, "was invalidated by PostgreSQL (wal_status = lost: its WAL was removed)")
    if info.active_pid is not None:
        raise SourceError(
            f"slot '{slot}' is in use by server process {info.active_pid} (is another capture running?)",
            hint="stop the other consumer, or choose another slot name",
        )
    return info


def create(repl: Connection, slot: str) -> tuple[int, str]:
    """Create the slot, exporting its snapshot; returns (consistent point, snapshot name)."""
    with repl.cursor() as cur:
        try:
            cur.execute(f"CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput EXPORT_SNAPSHOT")
        except psycopg2.Error as exc:
            raise SourceError(f"cannot create replication slot '{slot}': {str(exc).strip()}") from exc
        _, consistent_point, snapshot_name, _ = cur.fetchone()  # type: ignore[misc]
    return parse_lsn(consistent_point), snapshot_name


def drop_when_released(conn: Connection, slot: str, *, wait: float = 15.0) -> bool:
    """Drop ``slot`` once no process holds it (its replication connection was just closed); False if
    it does not exist."""
    if released(conn, slot, wait) is None:
        return False
    drop(conn, slot)
    return True


def drop(conn: Connection, slot: str) -> None:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    conn.commit()


def wait_caught_up(
    dsn: str,
    slot: str,
    *,
    timeout: float,
    alive: Callable[[], bool] = lambda: True,
    sync: bool = True,
    state_dir: Path | None = None,
) -> float:
    """Wait until the slot is confirmed up to now; returns the seconds it took.

    With ``sync``, a tiny transaction is committed first, so reaching it proves every
    commit before it is in Kafka even when the captured tables are idle. A new slot is
    confirmed at its consistent point before its snapshot is done: with ``state_dir``,
    the snapshot must be done too.
    """
    started = time.monotonic()
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            if sync:
                cur.execute("SELECT pg_logical_emit_message(true, 'headwater.sync', '')")
            cur.execute("SELECT pg_current_wal_lsn()::text")
            target = parse_lsn(cur.fetchone()[0])  # type: ignore[index]
        while time.monotonic() - started < timeout:
            if not alive():
                raise FatalError(f"capture stopped before slot '{slot}' caught up")
            info = find(conn, slot)
            confirmed = info is not None and (info.confirmed_lsn or 0) >= target
            if confirmed and (state_dir is None or snapshot_done(state_dir, slot)):
                return time.monotonic() - started
            time.sleep(0.05)
    finally:
        conn.close()
    raise FatalError(f"slot '{slot}' did not catch up within {timeout:.0f} s")
