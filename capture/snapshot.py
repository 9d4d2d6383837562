"""The consistent snapshot: every captured row as of the slot's exported snapshot.

Promise: several connections import the same exported snapshot and copy the
tables with ``COPY ... TO STDOUT`` (big tables split into ranges of heap pages, so
they go in parallel); each row becomes a READ change on the raw topic with the
slot's consistent point as its commit LSN. Progress (rows done per table, rate,
ETA) is logged and kept in the state. ``run`` returns only after Kafka acknowledged
every row; the caller then writes SNAPSHOT_END and marks the snapshot done.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import psycopg2
from psycopg2 import sql

from capture.catalog import Connection, TableRef, connect
from capture.changes import ChangeSink, snapshot_change
from capture.encoder import RowEncoder
from capture.errors import SourceError
from capture.state import State

log = logging.getLogger("headwater.capture")
_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}


def copy_field(raw: str) -> str | None:
    """One field of COPY's text format: \\N is NULL, backslash escapes decoded."""
    if "\\" not in raw:
        return raw
    if raw == "\\N":
        return None
    out, i = [], 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\\" and i + 1 < len(raw):
            out.append(_ESCAPES.get(raw[i + 1], raw[i + 1]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


class _Lines:
    """A file-like target for copy_expert that yields complete COPY lines to a callback."""

    def __init__(self, on_line: object) -> None:
        self.on_line = on_line
        self.rest = b""

    def write(self, data: bytes | str) -> None:
        chunk = data.encode() if isinstance(data, str) else data
        lines = (self.rest + chunk).split(b"\n")
        self.rest = lines.pop()
        for line in lines:
            self.on_line(line.decode("utf-8"))  # type: ignore[operator]


@dataclass(frozen=True)
class Chunk:
    table: TableRef
    first_page: int | None  # None: whole table
    last_page: int | None  # exclusive; None: to the end

    def query(self, columns: tuple[str, ...]) -> sql.Composed:
        cols = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
        base = sql.SQL("SELECT {} FROM ONLY {}").format(cols, sql.Identifier(self.table.schema, self.table.name))
        if self.first_page is None:
            return sql.SQL("COPY ({}) TO STDOUT").format(base)
        cond = sql.SQL(" WHERE ctid >= {}::tid").format(sql.Literal(f"({self.first_page},0)"))
        if self.last_page is not None:
            cond += sql.SQL(" AND ctid < {}::tid").format(sql.Literal(f"({self.last_page},0)"))
        return sql.SQL("COPY ({}) TO STDOUT").format(base + cond)


def plan(conn: Connection, tables: list[TableRef], chunk_pages: int) -> tuple[list[Chunk], dict[str, int]]:
    """Chunks of heap pages per table, biggest tables first, and row estimates."""
    chunks: list[Chunk] = []
    estimates: dict[str, int] = {}
    sizes = []
    with conn.cursor() as cur:
        for table in tables:
            cur.execute("SELECT relpages, greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = %s", (table.oid,))
            pages, tuples = cur.fetchone()  # type: ignore[misc]
            estimates[table.qualified] = int(tuples)
            sizes.append((pages, table))
    conn.commit()
    for pages, table in sorted(sizes, key=lambda s: -s[0]):
        if pages <= chunk_pages:
            chunks.append(Chunk(table, None, None))
            continue
        starts = list(range(0, pages, chunk_pages))
        for i, start in enumerate(starts):
            chunks.append(Chunk(table, start, starts[i + 1] if i + 1 < len(starts) else None))
    return chunks, estimates


class Progress:
    """Rows copied per table; logs rate and ETA every few seconds."""

    def __init__(self, estimates: dict[str, int], state: State) -> None:
        self.estimates = estimates
        self.done = dict.fromkeys(estimates, 0)
        self.finished: set[str] = set()
        self.state = state
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._last_report = 0.0

    def add(self, table: str, rows: int) -> None:
        with self._lock:
            self.done[table] += rows

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < 2.0:
            return
        self._last_report = now
        with self._lock:
            total = sum(self.done.values())
            estimate = max(sum(self.estimates.values()), total)
            snapshot = dict(self.done)
        rate = total / max(now - self.started, 1e-6)
        eta = (estimate - total) / rate if rate > 0 else float("inf")
        parts = ", ".join(f"{t} {d}/{max(self.estimates[t], d)}" for t, d in snapshot.items())
        log.info("snapshot: %d/%d rows, %.0f rows/s, ETA %.0f s (%s)", total, estimate, rate, eta, parts)
        for table, done in snapshot.items():
            self.state.progress(table, done, max(self.estimates[table], done), table in self.finished)


def _import(dsn: str, snapshot_name: str) -> Connection:
    conn = connect(dsn)
    with conn.cursor() as cur:
        cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
        except psycopg2.Error as exc:
            conn.close()
            raise SourceError(f"cannot import exported snapshot {snapshot_name}: {exc}") from exc
    return conn


def _copy_chunk(
    conn: Connection,
    chunk: Chunk,
    encoder: RowEncoder,
    sink: ChangeSink,
    progress: Progress,
    state_lock: threading.Lock,
    state: State,
    lsn: int,
) -> None:
    columns = tuple(c.name for c in encoder.table.columns)
    table = encoder.table
    rows = 0

    def on_line(line: str) -> None:
        nonlocal rows
        fields = line.split("\t")
        texts: Sequence[str | None] = fields if "\\" not in line else [copy_field(f) for f in fields]
        values = encoder.convert(texts)
        key = encoder.encode_key(values)
        sink.emit(snapshot_change(table, key, encoder.encode_value(values)))
        if key is not None and encoder.toastable:
            big = encoder.large_values(texts)
            if big:
                with state_lock:
                    for i, text in big:
                        state.remember(table.qualified, key[5:], i, lsn, text)
        rows += 1
        if rows % 5000 == 0:
            progress.add(table.qualified, 5000)
            progress.report()

    with conn.cursor() as cur:
        cur.copy_expert(chunk.query(columns), _Lines(on_line))
    progress.add(table.qualified, rows % 5000)


def run(
    dsn: str,
    snapshot_name: str,
    chunks: list[Chunk],
    encoders: dict[str, RowEncoder],
    sink: ChangeSink,
    progress: Progress,
    state: State,
    lsn: int,
    workers: int,
) -> int:
    """Copy every chunk with ``workers`` connections; returns rows emitted."""
    todo: queue.Queue[Chunk] = queue.Queue()
    for chunk in chunks:
        todo.put(chunk)
    remaining = {t: sum(1 for c in chunks if c.table.qualified == t) for t in progress.estimates}
    errors: list[BaseException] = []
    state_lock = threading.Lock()
    lock = threading.Lock()

    def work(conn: Connection) -> None:
        try:
            for chunk in _drain(todo):
                if errors:
                    return
                _copy_chunk(conn, chunk, encoders[chunk.table.qualified], sink, progress, state_lock, state, lsn)
                with lock:
                    remaining[chunk.table.qualified] -= 1
                    if remaining[chunk.table.qualified] == 0:
                        progress.finished.add(chunk.table.qualified)
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()

    conns = [_import(dsn, snapshot_name) for _ in range(min(workers, max(len(chunks), 1)))]
    threads = [threading.Thread(target=work, args=(c,), name=f"snapshot-{i}") for i, c in enumerate(conns)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    with state_lock:
        state.db.commit()
    progress.report(force=True)
    return sum(progress.done.values())


def _drain(todo: queue.Queue[Chunk]) -> Iterator[Chunk]:
    while True:
        try:
            yield todo.get_nowait()
        except queue.Empty:
            return
