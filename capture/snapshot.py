"""The consistent snapshot: every captured row as of the slot's exported snapshot.

Promise: the tables are copied with ``COPY ... TO STDOUT`` under the slot's exported
snapshot — by worker processes, each importing the snapshot on its own connection
and writing with its own producer, when the snapshot is big (big tables are split
into ranges of heap pages, so they go in parallel); each row becomes a READ change
on the raw topic with one below the slot's consistent point as its commit LSN
(``changes.snapshot_commit_lsn``) and a position
unique within the snapshot. In the Avro format on a UTF8 server the COPY text goes
straight into the compiled ``capture._copier.Copier``, which writes whole messages
and sends them itself through a ``SnapshotSender`` (librdkafka driven from C); rows
it cannot write, and the json format, take the general path (``copy_field`` +
``RowEncoder``), which is the reference. The worker processes are ``capture.workers``.
Progress (rows done per table, rate, ETA) is logged and kept in the state. ``run``
returns only after Kafka acknowledged every row; the caller then writes SNAPSHOT_END
and marks the snapshot done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg2
from psycopg2 import sql

from capture._copier import Copier
from capture.catalog import Connection, TableRef, TypeCache, connect, server_utf8, table_schema
from capture.changes import ChangeSink
from capture.config import CaptureConfig
from capture.encoder import ChangeWriter, RowEncoder, change_writer
from capture.errors import SourceError
from capture.producer import ChangeProducer, SnapshotSender
from capture.schemas import Ids
from capture.state import State
from capture.transcoder import CopierSpec, copier_spec
from tables.catalog import TableSchema
from tables.errors import HeadwaterError
from tables.wire import body

log = logging.getLogger("headwater.capture")
PARALLEL_MIN_ROWS = 200_000  # below this, worker processes cost more to start than they save
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
            self.on_line(line)  # type: ignore[operator]


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
    """Rows copied per table (fed by the capture process only); logs rate and ETA every few seconds."""

    def __init__(self, estimates: dict[str, int], chunks: list[Chunk], state: State,
                 on_report: Callable[[str, int, int], None] | None = None) -> None:  # fmt: skip
        """``on_report(table, rows read, rows expected)`` at each report (``capture.metrics``)."""
        self.estimates = estimates
        self.on_report = on_report
        self.done = dict.fromkeys(estimates, 0)
        self.chunks_left = {t: sum(1 for c in chunks if c.table.qualified == t) for t in estimates}
        self.state = state
        self.started = time.monotonic()
        self._last_report = 0.0

    def add(self, table: str, rows: int, chunk_done: bool) -> None:
        self.done[table] += rows
        if chunk_done:
            self.chunks_left[table] -= 1
        self.report()

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < 2.0:
            return
        self._last_report = now
        total = sum(self.done.values())
        estimate = max(sum(self.estimates.values()), total)
        rate = total / max(now - self.started, 1e-6)
        eta = (estimate - total) / rate if rate > 0 else float("inf")
        parts = ", ".join(f"{t} {d}/{max(self.estimates[t], d)}" for t, d in self.done.items())
        log.info("snapshot: %d/%d rows, %.0f rows/s, ETA %.0f s (%s)", total, estimate, rate, eta, parts)
        for table, done in self.done.items():
            self.state.progress(table, done, max(self.estimates[table], done), self.chunks_left[table] == 0)
            if self.on_report is not None:
                self.on_report(table, done, self.estimates[table])


def import_snapshot(dsn: str, snapshot_name: str) -> Connection:
    """A connection inside the exported snapshot ``snapshot_name`` (a read-only repeatable-read transaction)."""
    conn = connect(dsn)
    with conn.cursor() as cur:
        cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
        except psycopg2.Error as exc:
            conn.close()
            raise SourceError(f"cannot import exported snapshot {snapshot_name}: {exc}") from exc
    return conn


@dataclass(frozen=True)
class Job:
    """Everything a snapshot worker needs; picklable, so workers can be processes."""

    cfg: CaptureConfig
    snapshot_name: str
    lsn: int
    time_us: int
    ids: dict[str, Ids]  # table -> its shape's schema ids (value, key, nested change record)
    change_ids: tuple[int, int]  # raw topic (key, value) schema ids
    index: int = 0
    stride: int = 1


Report = Callable[[str, int, bool], None]  # (table, rows copied since last report, chunk finished)


class Copying:
    """One process's means to copy chunks: its connections and producer. Made from the config
    alone, so worker processes make it while capture is still setting up the snapshot."""

    def __init__(self, cfg: CaptureConfig) -> None:
        self.cfg = cfg
        self.catalog_conn = connect(cfg.dsn.reveal())
        try:
            self.fast = cfg.format == "avro" and server_utf8(self.catalog_conn)
            self.sender = SnapshotSender.open(cfg) if self.fast else None
            self.producer = None if self.sender else ChangeProducer(cfg)
        except BaseException:
            self.catalog_conn.close()
            raise

    def run(self, job: Job, chunks: Iterable[Chunk], report: Report) -> tuple[int, int]:
        """Copy ``chunks``; returns (rows, highest position used + 1) once Kafka acknowledged every row."""
        conn = import_snapshot(job.cfg.dsn.reveal(), job.snapshot_name)
        sink = ChangeSink(change_writer(job.cfg.format, *job.change_ids, job.cfg.raw_images), self.producer)
        sink.start_snapshot(job.lsn, job.time_us, first=job.index, stride=job.stride)
        state = State(job.cfg.state_dir, job.cfg.slot)
        types = TypeCache(self.catalog_conn)
        encoders: dict[str, tuple[RowEncoder, CopierSpec | None]] = {}
        rows = 0
        try:
            for chunk in chunks:
                name = chunk.table.qualified
                if name not in encoders:
                    shape = table_schema(self.catalog_conn, types, job.cfg.topic_prefix, chunk.table)
                    ids = job.ids[name]
                    sink.writer.learn(shape, ids)
                    encoder = RowEncoder(shape, ids.value, ids.key, job.cfg.format)
                    encoders[name] = (encoder, copier_spec(encoder) if self.fast else None)
                rows += _copy_chunk(conn, chunk, *encoders[name], sink, self.sender, report, state, job.lsn)
            (self.sender or sink.producer).flush(timeout=600)
            state.db.commit()
        finally:
            state.close()
            conn.close()
        return rows, sink.next_position()

    def close(self) -> None:
        if self.sender:
            self.sender.close()
        self.catalog_conn.close()


def copy_chunks(job: Job, chunks: Iterable[Chunk], report: Report) -> tuple[int, int]:
    """Copy ``chunks`` in this process (see ``Copying.run``)."""
    copying = Copying(job.cfg)
    try:
        return copying.run(job, chunks, report)
    finally:
        copying.close()


BATCH_ROWS = 5000  # rows per call into librdkafka and per progress report


GeneralRow = Callable[[bytes], tuple[bytes, bytes | None, list[tuple[int, str]] | None]]


def general_path(encoder: RowEncoder) -> GeneralRow:
    """``row(line) -> (value, key, large values)``: the reference — COPY fields unescaped, converted and
    encoded by the RowEncoder (a value it cannot hold raises, naming table and column)."""

    def row(line: bytes) -> tuple[bytes, bytes | None, list[tuple[int, str]] | None]:
        text = line.decode("utf-8")
        fields = text.split("\t")
        texts: Sequence[str | None] = fields if "\\" not in text else [copy_field(f) for f in fields]
        values = encoder.convert(texts)
        key = encoder.encode_key(values)
        return encoder.encode_value(values), key, encoder.large_values(texts) if encoder.toastable else None

    return row


def _copy_chunk(conn: Connection, chunk: Chunk, encoder: RowEncoder, spec: CopierSpec | None, sink: ChangeSink,
                sender: SnapshotSender | None, report: Report, state: State, lsn: int) -> int:  # fmt: skip
    """COPY one chunk to the raw topic: through the compiled ``Copier`` (Avro on a UTF8 server), or
    line by line through the general path. Returns the rows copied."""
    table = encoder.table
    query = chunk.query(tuple(c.name for c in table.columns))
    if spec is not None:
        return _copy_compiled(conn, query, table, spec, general_path(encoder), sink, sender, report, state, lsn)
    general, emit, qualified = general_path(encoder), sink.snapshot_emitter(table), table.qualified
    rows = 0

    def on_line(line: bytes) -> None:
        nonlocal rows
        after, key, large = general(line)
        emit(key, after)
        if key is not None and large:
            for i, value in large:
                state.remember(qualified, body(key), i, lsn, value)
        rows += 1
        if rows % BATCH_ROWS == 0:
            state.db.commit()  # the TOAST values so far: the progress report below writes the same state file
            report(qualified, BATCH_ROWS, False)

    with conn.cursor() as cur:
        cur.copy_expert(query, _Lines(on_line))
    report(qualified, rows % BATCH_ROWS, True)
    return rows


def _copy_compiled(conn: Connection, query: sql.Composed, table: TableSchema, spec: CopierSpec, general: GeneralRow,
                   sink: ChangeSink, sender: SnapshotSender | None, report: Report, state: State,
                   lsn: int) -> int:  # fmt: skip
    """COPY straight into ``capture._copier.Copier``: no Python per row unless a row needs the general
    path. With a ``sender`` the Copier also sends each message itself; else in batches of dicts."""
    kafka_key, head, size, position, stride = sink.snapshot_head(table)
    qualified = table.qualified

    def on_batch(batch: list[dict[str, Any]] | int, large: list[tuple[bytes, int, str]]) -> None:
        if isinstance(batch, int):  # the Copier sent them through the sender
            sent = batch
        else:
            sink.producer.send_batch(batch)
            sent = len(batch)
        for key, i, value in large:
            state.remember(qualified, key, i, lsn, value)
        if large:
            state.db.commit()  # the TOAST values so far: the progress report below writes the same state file
        report(qualified, sent, False)

    copier = Copier(spec.columns, spec.value_prefix, spec.key_prefix, head, size, kafka_key, position, stride,
                    general, on_batch, BATCH_ROWS, sender.handle if sender else None,
                    nested=isinstance(sink.writer, ChangeWriter) and sink.writer.nested)  # fmt: skip
    try:
        with conn.cursor() as cur:
            cur.copy_expert(query, copier)
        copier.finish()
    finally:
        sink.skip(copier.rows)
    report(qualified, 0, True)
    return copier.rows


class Interrupted(HeadwaterError):
    """Capture was asked to stop during the snapshot; the next run starts the snapshot over."""


class Pool(Protocol):
    """Worker processes that copy chunks (``capture.workers.Workers``): (rows, bytes) copied."""

    def run(self, job: Job, chunks: list[Chunk], report: Report, check: Callable[[], None]) -> tuple[int, int]: ...


def run(job: Job, chunks: list[Chunk], progress: Progress, pool: Pool | None,
        stop: threading.Event | None = None) -> tuple[int, int]:  # fmt: skip
    """Copy every chunk, in this process or by the ``pool``'s worker processes (when there is one
    and the snapshot is big enough); returns (rows, next position).

    Raises ``Interrupted`` soon after ``stop`` is set.
    """
    stop = stop or threading.Event()

    def report(table: str, rows: int, chunk_done: bool) -> None:
        check(stop)
        progress.add(table, rows, chunk_done)

    if pool is None or len(chunks) <= 1 or sum(progress.estimates.values()) < PARALLEL_MIN_ROWS:
        result = copy_chunks(job, chunks, report)
    else:
        result = pool.run(job, chunks, report, lambda: check(stop))
    progress.report(force=True)
    return result


def check(stop: threading.Event) -> None:
    if stop.is_set():
        raise Interrupted("stopped during the snapshot; the next run starts it over")
