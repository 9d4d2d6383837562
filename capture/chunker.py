"""A backfill's reads: watermarks, chunks by key, retraction checks (the SQL side of ``capture.backfill``).

Promise: only what capture's role may do — SELECT on the table, the catalog, and
``pg_logical_emit_message`` for the watermarks. The ``Reader`` reads in a thread of its own,
on a connection of its own, one ``Job`` at a time, in three round trips: the low watermark
and the read's transaction (read-only REPEATABLE READ, after the low watermark committed)
with ``pg_current_snapshot()`` (what the read could see); the read; the end of the
transaction and the high watermark. A chunk's read is the table's shape (checked against
the encoder's), the
key that closes the chunk (``backfill_chunk_rows`` rows after the previous chunk, by the
table's key in its index's order — composite keys compared as rows, so the index is used),
then the rows with ``COPY``: through the compiled ``Copier`` in its rows mode on the fast
path (Avro on a UTF8 server), else the general path (the reference, same bytes). A table
without key (``allow_unkeyed``) is read in ranges of heap pages instead. A ``--where``
predicate narrows every read; it runs inside the read-only transaction with capture's
privileges, after ``backfill.check_predicate`` kept it inside its parentheses. Key values
travel as PostgreSQL's own text and come back through casts to the key's types, so every
key type compares exactly as the table's index does.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg2
from psycopg2 import sql

from capture import retract
from capture._copier import Copier
from capture.backfill import MASK, WATERMARK_PREFIX, Row, SignalError, Snapshot
from capture.catalog import Connection, TableRef, TypeCache, connect, connection_lost
from capture.encoder import RowEncoder
from capture.snapshot import _Lines, general_path
from capture.transcoder import CopierSpec
from tables.catalog import TableSchema
from tables.wire import body

Large = list[tuple[bytes, int, str]]  # (key body, column index, text) of values long enough to be TOASTed
Bound = list[str | None]  # a key as the texts of its columns, in the key's order (or [page] without key)

KEY_SQL = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod)
FROM (SELECT i.indkey FROM pg_index i WHERE i.indrelid = %s AND (i.indisreplident OR i.indisprimary)
      ORDER BY i.indisreplident DESC LIMIT 1) i,
     unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = %s AND a.attnum = k.attnum
ORDER BY k.ord
"""


@dataclass(frozen=True)
class Keyset:
    """How one table is read in chunks: its shape, its key columns in index order with their types (none for a
    table without key), and the rows one heap page holds (for tables without key)."""

    table: TableRef
    shape: TableSchema
    key: tuple[str, ...]
    types: tuple[str, ...]
    per_page: float = 100.0

    @property
    def relation(self) -> sql.Composable:
        return sql.SQL("ONLY {}").format(sql.Identifier(self.table.schema, self.table.name))

    def columns(self) -> sql.Composable:
        return sql.SQL(", ").join(sql.Identifier(c) for c in self.key)

    def order(self, direction: str = "") -> sql.Composable:
        """ORDER BY the key, the columns named through the table (never the text outputs of ``texts``)."""
        table = sql.Identifier(self.table.schema, self.table.name)
        return sql.SQL(", ").join(sql.SQL("{}.{}" + direction).format(table, sql.Identifier(c)) for c in self.key)

    def texts(self) -> sql.Composable:
        """The key columns as text, named apart from the columns (ORDER BY a bare name would take the text)."""
        return sql.SQL(", ").join(sql.SQL("{}::text AS {}").format(sql.Identifier(c), sql.Identifier(f"_hw_{i}"))
                                  for i, c in enumerate(self.key))  # fmt: skip

    def row(self, bound: Bound) -> sql.Composable:
        """A key as a row of typed literals: ``('7'::integer, 'x'::text)``."""
        values = (sql.SQL("{}::{}").format(sql.Literal(v), sql.SQL(t)) for v, t in zip(bound, self.types, strict=True))
        return sql.SQL("({})").format(sql.SQL(", ").join(values))

    def where(self, predicate: str | None, after: Bound | None, upto: Bound | None) -> sql.Composable:
        """The rows of one range: after ``after`` (exclusive) up to ``upto`` (inclusive), matching ``predicate``."""
        parts: list[sql.Composable] = [sql.SQL("({}\n)").format(sql.SQL(predicate))] if predicate else []
        if not self.key:
            first = int(after[0] or 0) if after else 0
            parts.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({first},0)")))
            if upto is not None:
                parts.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({int(upto[0] or 0)},0)")))
        else:
            keys = sql.SQL("({})").format(self.columns())
            if after is not None:
                parts.append(sql.SQL("{} > {}").format(keys, self.row(after)))
            if upto is not None:
                parts.append(sql.SQL("{} <= {}").format(keys, self.row(upto)))
        return sql.SQL(" AND ").join(parts) if parts else sql.SQL("true")


def keyset(conn: Connection, table: TableRef, shape: TableSchema) -> Keyset:
    """The table's key columns in its key index's order (a table without key: none, and its rows per page)."""
    with conn.cursor() as cur:
        cur.execute(KEY_SQL, (table.oid, table.oid))
        rows = cur.fetchall()
        cur.execute("SELECT greatest(reltuples, 0) / greatest(relpages, 1) FROM pg_class WHERE oid = %s",
                    (table.oid,))  # fmt: skip
        per_page = float(cur.fetchone()[0] or 100.0)  # type: ignore[index]
    return Keyset(table, shape, tuple(r[0] for r in rows), tuple(r[1] for r in rows), max(per_page, 1.0))


def _execute(conn: Connection, query: sql.Composable, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    with conn.cursor() as cur:
        cur.execute(query, args)
        return cur.fetchall() if cur.description else []


def validate(conn: Connection, table: TableRef, predicate: str | None) -> int:
    """The rows a backfill of ``table`` will read, as the planner estimates them; a predicate PostgreSQL
    refuses (syntax, unknown column, ...) raises ``SignalError`` with its message."""
    where = sql.SQL("({}\n)").format(sql.SQL(predicate)) if predicate else sql.SQL("true")
    query = sql.SQL("EXPLAIN (FORMAT JSON) SELECT 1 FROM ONLY {} WHERE {}").format(
        sql.Identifier(table.schema, table.name), where)  # fmt: skip
    _execute(conn, sql.SQL("BEGIN READ ONLY"))
    try:
        plan = _execute(conn, query)[0][0]
    except psycopg2.Error as exc:
        if connection_lost(exc):
            raise
        raise SignalError(f"PostgreSQL refuses the predicate on {table.qualified}: "
                          f"{str(exc).strip().splitlines()[0]}") from exc  # fmt: skip
    finally:
        _rollback(conn)
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return int(plan[0]["Plan"]["Plan Rows"])


def last_bound(conn: Connection, ks: Keyset, predicate: str | None) -> Bound | None:
    """The largest key matching ``predicate`` now (rows inserted after it come through the stream), or the
    number of heap pages for a table without key; None when there is nothing to read."""
    if not ks.key:
        rows = _execute(conn, sql.SQL("SELECT pg_relation_size({}) / current_setting('block_size')::int").format(
            sql.Literal(ks.table.oid)))  # fmt: skip
        pages = int(rows[0][0])
        return [str(pages)] if pages else None
    order = ks.order(" DESC")
    query = sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} LIMIT 1").format(
        ks.texts(), ks.relation, ks.where(predicate, None, None), order)  # fmt: skip
    found = _execute(conn, query)
    return list(found[0]) if found else None


def watermark(conn: Connection, kind: str, token: str) -> None:
    """Write the low or high watermark of chunk ``token`` into the WAL (its own transaction)."""
    _execute(conn, sql.SQL("SELECT pg_logical_emit_message(true, %s, %s)"), (WATERMARK_PREFIX, _mark(kind, token)))


def _mark(kind: str, token: str) -> str:
    return json.dumps({"w": kind, "t": token})


# The low watermark, then the read's transaction and what it can see, in one round trip. The low watermark's
# commit does not wait for its WAL flush (the high watermark's, later in the WAL, flushes it): the read only
# has to start after it, and PostgreSQL sends neither before both are on disk.
OPEN_SQL = """
BEGIN; SET LOCAL synchronous_commit TO off; SELECT pg_logical_emit_message(true, %s, %s); COMMIT;
BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SELECT pg_current_snapshot()::text
"""
CLOSE_SQL = "COMMIT; SELECT pg_logical_emit_message(true, %s, %s)"  # the read ends, then the high watermark


def open_read(conn: Connection, token: str) -> Snapshot:
    """The low watermark of ``token``, then a read-only REPEATABLE READ transaction: what it can see."""
    try:
        found = _execute(conn, sql.SQL(OPEN_SQL), (WATERMARK_PREFIX, _mark("low", token)))
        return Snapshot.parse(found[0][0])
    except BaseException:
        _rollback(conn)
        raise


def close_read(conn: Connection, token: str) -> None:
    """The read's transaction ends, then the high watermark of ``token`` is written (and flushed)."""
    try:
        _execute(conn, sql.SQL(CLOSE_SQL), (WATERMARK_PREFIX, _mark("high", token)))
    except BaseException:
        _rollback(conn)
        raise


def watch_start(conn: Connection, publication: str, table: TableRef) -> int | None:
    """A transaction id above every one assigned so far (a new transaction's, committed without waiting for a
    synchronous standby; as a 32-bit xid, as pgoutput gives them: ``backfill.vouches``), if ``publication``
    carries every delete and truncate of ``table`` (no row filter); else None, as on a standby, which assigns
    no xid."""
    filtered: sql.Composable = sql.SQL("false")  # row filters came with PostgreSQL 15
    if conn.server_version >= 150000:
        filtered = sql.SQL("EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid"
                           " WHERE p.pubname = {} AND r.prrelid = {} AND r.prqual IS NOT NULL)").format(
            sql.Literal(publication), sql.Literal(table.oid))  # fmt: skip
    query = sql.SQL("BEGIN; SET LOCAL synchronous_commit TO off; SELECT pg_current_xact_id()::text, coalesce((SELECT"
                    " pubdelete AND pubtruncate FROM pg_publication WHERE pubname = {}), false) AND NOT {}").format(
        sql.Literal(publication), filtered)  # fmt: skip
    try:
        xid, published = _execute(conn, query)[0]
        _execute(conn, sql.SQL("COMMIT"))
    except psycopg2.Error as exc:
        if connection_lost(exc):
            raise
        _rollback(conn)
        return None
    return int(xid) & MASK if published else None


def parse_watermark(content: bytes) -> tuple[str, str] | None:
    """(kind, token) of a watermark message's content, None if it is not one."""
    try:
        found = json.loads(content)
        return str(found["w"]), str(found["t"])
    except (ValueError, KeyError, TypeError):
        return None


class ShapeChanged(Exception):
    """The table's columns changed since its encoder was made: make it again, then read the chunk."""


@dataclass
class Chunk:
    """One chunk as read: its rows, their TOASTable values, where the next chunk starts, whether it is the
    last one."""

    rows: list[Row]
    large: Large
    upper: Bound | None
    last: bool


class Reading:
    """Reads one table's chunks with one encoder (the shape registered for its topic)."""

    def __init__(self, ks: Keyset, encoder: RowEncoder, spec: CopierSpec | None, size: int,
                 decode: retract.KeyDecoder) -> None:  # fmt: skip
        self.ks, self.encoder, self.spec, self.size, self.decode = ks, encoder, spec, size, decode

    def read(self, conn: Connection, predicate: str | None, after: Bound | None, upto: Bound,
             shape: Callable[[], TableSchema]) -> Chunk:  # fmt: skip
        """The next chunk after ``after`` (None: the first), never past ``upto``, inside the caller's read
        transaction (``open_read``); ``ShapeChanged`` if the table's shape (``shape()``, read in it) is no
        longer the encoder's."""
        if shape() != self.encoder.table:
            raise ShapeChanged(self.ks.table.qualified)
        rows, large, upper = self._read(conn, predicate, after, upto)
        return Chunk(rows, large, upper or upto, upper is None or upper == upto)

    def _read(self, conn: Connection, predicate: str | None, after: Bound | None,
              upto: Bound) -> tuple[list[Row], Large, Bound | None]:  # fmt: skip
        """The chunk's rows and the key that closes it (None: the rest up to ``upto`` was read). By key: the
        first ``size`` rows in key order, the next chunk starting after the last one's key (its image decoded
        back to PostgreSQL's text; asked from PostgreSQL when a date or timestamp in it is at an end of Avro's
        range, where infinity and a real value look the same); without key: a range of heap pages."""
        ks, table = self.ks, self.encoder.table
        if not ks.key:
            first = int(after[0] or 0) if after else 0
            end = first + max(1, round(self.size / ks.per_page))
            upper: Bound | None = [str(end)] if end < int(upto[0] or 0) else None
            rows, large = self._copy(conn, ks.where(predicate, after, upper or upto), sql.SQL(""))
            return rows, large, upper
        limit = sql.SQL(" ORDER BY {} LIMIT {}").format(ks.order(), sql.Literal(self.size))
        rows, large = self._copy(conn, ks.where(predicate, after, upto), limit)
        if len(rows) < self.size:
            return rows, large, None
        last = rows[-1][0]
        assert last is not None
        values = dict(zip([c.name for c in table.columns if c.is_key], self.decode(last), strict=True))
        if any(retract.at_an_end(v) for v in values.values()):  # infinity, or a real value there: ask
            return rows, large, self._nth_key(conn, predicate, after, upto)
        return rows, large, [retract.pg_text(values[k], literal=True) for k in ks.key]

    def _nth_key(self, conn: Connection, predicate: str | None, after: Bound | None, upto: Bound) -> Bound:
        """The texts of the chunk's last key as PostgreSQL gives them (same transaction: the same rows)."""
        ks = self.ks
        query = sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} LIMIT 1 OFFSET {}").format(
            ks.texts(), ks.relation, ks.where(predicate, after, upto), ks.order(), sql.Literal(self.size - 1))
        return list(_execute(conn, query)[0])

    def _copy(self, conn: Connection, where: sql.Composable, then: sql.Composable) -> tuple[list[Row], Large]:
        """The rows COPY gives (in its order) and their TOASTable values."""
        cols = sql.SQL(", ").join(sql.Identifier(c.name) for c in self.encoder.table.columns)
        query = sql.SQL("COPY (SELECT {} FROM {} WHERE {}{}) TO STDOUT").format(cols, self.ks.relation, where, then)
        rows: list[Row] = []
        large: Large = []
        target = self._target(rows, large)
        with conn.cursor() as cur:
            cur.copy_expert(query, target)
        if isinstance(target, Copier):
            target.finish()
        return rows, large

    def _target(self, rows: list[Row], large: Large) -> Copier | _Lines:
        """Where COPY's text goes: the Copier (rows mode) or the general path, both into ``rows``."""
        general = general_path(self.encoder)
        if self.spec is None:
            return _Lines(lambda line: _general_row(general, line, rows, large))

        def on_batch(batch: list[Row], big: Large) -> None:
            rows.extend(batch)
            large.extend(big)

        s = self.spec
        return Copier(s.columns, s.value_prefix, s.key_prefix, b"", b"", b"", 0, 1, general, on_batch,
                      self.size + 1, rows=True)  # fmt: skip


def _general_row(general: Callable[[bytes], tuple[bytes, bytes | None, list[tuple[int, str]] | None]], line: bytes,
                 rows: list[Row], large: Large) -> None:  # fmt: skip
    value, key, big = general(line)
    rows.append((key, value))
    if key is not None and big:
        large.extend((body(key), i, text) for i, text in big)


def _rollback(conn: Connection) -> None:
    if not conn.closed:
        with contextlib.suppress(psycopg2.Error):
            _execute(conn, sql.SQL("ROLLBACK"))


# ---- the reader's thread ------------------------------------------------------------------
@dataclass
class Job:
    """One read between watermarks for the ``Reader``'s thread: ``read(conn, types)`` runs inside the read
    transaction. Its ``result`` and ``snapshot`` are in place (``ready``) before the high watermark is
    written, so the stream finds them when the watermark comes through. ``done`` once the job ended;
    ``error`` is what it raised (no high watermark then)."""

    token: str
    read: Callable[[Connection, TypeCache], Any]
    result: Any = None
    snapshot: Snapshot | None = None
    ready: bool = False
    error: Exception | None = None
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return self.ended.is_set()


class Reader:
    """A backfill's reads in a thread of their own, on a connection of their own (autocommit), one job at a
    time, while the stream goes on in capture's thread: the low watermark, the read, the high watermark.
    ``wake`` is a file descriptor that becomes readable when a job ends, or when ``poke`` is called (the stream
    waits on it too)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.wake, self._wake = os.pipe()
        os.set_blocking(self.wake, False)
        os.set_blocking(self._wake, False)  # a full pipe is readable already: a poke then adds nothing
        self.pipe = threading.Lock()  # held while ``_wake`` is written to and while it is closed
        self.conn: Connection | None = None
        self.thread = threading.Thread(target=self._run, name="backfill-reader", daemon=True)

    def submit(self, job: Job) -> None:
        if not self.thread.is_alive() and self.thread.ident is None:
            self.thread.start()
        self.jobs.put(job)

    def poke(self) -> None:
        """Make ``wake`` readable (from any thread; nothing once closed)."""
        with self.pipe:
            if self._wake >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake, b"x")

    def drain(self) -> None:
        """Empty ``wake`` (the caller looks at its job next)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake, 4096):
                pass

    def close(self) -> None:
        """Stop the thread (a read under way is cancelled) and close its connection."""
        self.jobs.put(None)
        if self.thread.ident is not None:
            conn = self.conn
            if conn is not None and not conn.closed:
                with contextlib.suppress(psycopg2.Error):
                    conn.cancel()
            self.thread.join(timeout=10)
        if not self.thread.is_alive():  # else it may still write to the pipe: left open
            with self.pipe:
                os.close(self.wake)
                os.close(self._wake)
                self._wake = -1

    def _run(self) -> None:
        types: TypeCache | None = None
        while (job := self.jobs.get()) is not None:
            try:
                if self.conn is None or self.conn.closed or types is None:
                    types = TypeCache(self._connect())
                self._do(types.conn, types, job)
            except Exception as exc:
                job.error, types = exc, None  # the types are read again: a DDL may have raced the read
            finally:
                job.ended.set()
                self.poke()
        if self.conn is not None:
            self.conn.close()

    def _connect(self) -> Connection:
        if self.conn is None or self.conn.closed:
            self.conn = connect(self.dsn)
            self.conn.autocommit = True
        return self.conn

    @staticmethod
    def _do(conn: Connection, types: TypeCache, job: Job) -> None:
        job.snapshot = open_read(conn, job.token)
        try:
            job.result = job.read(conn, types)
        except BaseException:
            _rollback(conn)
            raise
        job.ready = True
        close_read(conn, job.token)


def missing(conn: Connection, shape: TableSchema, keys: Sequence[bytes], decode: retract.KeyDecoder) -> list[bytes]:
    """Which of ``keys`` the table does not hold, inside the caller's read transaction (``retract.missing``)."""
    return retract.missing(conn, shape, keys, decode)
