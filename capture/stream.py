"""The change stream: pgoutput messages in, raw-topic changes out, the slot confirmed behind Kafka.

Promise: ``Streamer.handle`` folds decoded pgoutput messages into transactions and,
at each commit, emits the transaction's changes with their positions; rows are
encoded with the schema registered for the table's current shape (a changed shape
registers a new version first) — by the shape's transcoder when it can, else by the
general decoder and ``RowEncoder``, with the same bytes either way. Unchanged TOASTed
values are filled in from the old row (REPLICA IDENTITY FULL), the TOAST cache, or as
a last resort the table. Backfills (``capture.backfiller``) hook in through
``BackfillHooks``: every Relation message (a table may join the captured set), every row
inserted into the signal table, and — only while a backfill runs (``watch``) — every
commit with the watermark messages it carried; with no backfill running the stream pays
one attribute test per commit.
``Loop`` is the thin loop around it: read, handle, and every status interval
checkpoint and confirm the newest commit Kafka acknowledged, plus heartbeats; every second
(and while a send waits on a full producer queue) it tells ``capture.metrics`` about Kafka;
when the stream has nothing to read (or every 1000 messages) it lets a backfill hand its reader the next chunk
(a thread of the backfill's, which wakes the loop when it is done).

Which LSNs the slot is told (the checkpoint contract): the end LSN of a commit once
Kafka acknowledged every message up to it (a heartbeat's empty transaction too), and,
while capture is *settled* — every message it received is confirmed and no
transaction is open — the server's position from its keepalives: the server had
nothing more for this slot up to there, and a transaction still open on the server is
sent again after a restart, because PostgreSQL decodes every transaction whose commit
lies at or after the confirmed position. psycopg2 itself moves the slot that way on
keepalives (``ReplicationCursor``: flush position forwarded to the keepalive's WAL end
once the last message is confirmed), possibly before capture could checkpoint it; so a
slot may be found ahead of a *settled* checkpoint — safe, nothing lies between — and
only a slot ahead of an unsettled one means something else moved it.
"""

from __future__ import annotations

import gc
import logging
import select
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import psycopg2
from psycopg2 import sql

from capture import decoder as pg
from capture.backfill import WATERMARK_PREFIX
from capture.catalog import Connection, TypeCache, key_names, nullability, server_utf8
from capture.changes import ChangeSink, RowChange, TxBuffer
from capture.config import CaptureConfig
from capture.encoder import RowEncoder
from capture.metrics import CaptureMetrics
from capture.producer import ChangeProducer
from capture.schemas import register_table
from capture.state import State
from capture.transcoder import Transcoder, transcoder
from tables.catalog import ColumnInfo, TableSchema
from tables.logs import facts
from tables.registry import NoRegistry, Registry
from tables.wire import body, lsn_text

log = logging.getLogger("headwater.capture")
HEARTBEAT_PREFIX = "headwater.heartbeat"
KAFKA_EVERY = 1.0  # seconds between looks at the producer (queue, deliveries, Kafka answering)
_OID = struct.Struct("!I").unpack_from
INSERT, UPDATE, DELETE, NEW, KEY, OLD = b"IUDNKO"
ROW_CHANGES = frozenset((INSERT, UPDATE, DELETE))


class BackfillHooks(Protocol):
    """What the stream tells backfills (``capture.backfiller.Backfiller``)."""

    def relation(self, rel: pg.Relation) -> None:
        """Every Relation message; a table that joins the captured set is added to the streamer's ``keyed``."""

    def signal(self, values: dict[str, str | None], lsn: int) -> None:
        """A row inserted into the signal table, committed at ``lsn``."""

    def commit(self, changes: TxBuffer, xid: int, marks: list[bytes], commit: pg.Commit) -> None:
        """A commit (while a backfill runs), before its changes are sent, with its watermark messages."""

    def step(self) -> bool:
        """The stream has a moment: hand a backfill's next chunk to its reader if one is due, take what the
        reader finished (True if it did either)."""

    def waker(self) -> int:
        """A file descriptor that becomes readable when the backfills' reader finished a read (the stream's
        wait ends then, so the next chunk is handed over at once)."""

    def housekeeping(self, acked_lsn: int | None) -> None:
        """Every status interval: requests, new tables, progress, and what Kafka acknowledged."""

    def progress(self) -> list[Any]:
        """Every unfinished backfill's numbers (``capture.backfill.Progress``: table, rows, estimate, ...)."""


class Streamer:
    def __init__(
        self,
        cfg: CaptureConfig,
        conn: Connection,
        types: TypeCache,
        registrar: Registry | NoRegistry,
        sink: ChangeSink,
        state: State,
        keyed: dict[tuple[str, str], bool],
    ) -> None:
        self.cfg = cfg
        self.conn = conn
        self.types = types
        self.registrar = registrar
        self.sink = sink
        self.state = state
        self.keyed = keyed  # the captured tables, and whether they have a real key
        self.encoders: dict[int, RowEncoder | None] = {}
        # the fast path of captured tables' rows (Avro on a UTF8 server); the general one is the reference
        self.transcoders: dict[int, Transcoder] = {}
        self.fast = cfg.format == "avro" and server_utf8(conn)
        self.fast_rows = 0
        self.tx = TxBuffer(cfg.max_tx_memory, cfg.state_dir / "spill")
        self.begin: pg.Begin | None = None
        self.last_commit_lsn = 0
        self.last_commit_time = 0
        self.last_commit_seen = time.monotonic()
        self.backfills: BackfillHooks | None = None
        self.watch: BackfillHooks | None = None  # set while a backfill runs: it sees every commit
        self.marks: list[bytes] = []  # watermark messages of the transaction being read
        self.signal_oid = -1
        self.signal_columns: list[str] = []

    def handle(self, payload: bytes) -> None:
        kind = payload[0]
        if kind in ROW_CHANGES:
            fast = self.transcoders.get(_OID(payload, 1)[0])
            if fast is not None and self._transcode(kind, fast, payload):
                return
        self._handle(payload)

    def _handle(self, payload: bytes) -> None:
        msg = pg.decode(payload)
        kind = type(msg)
        if kind is pg.Insert:
            self._insert(msg)  # type: ignore[arg-type]
        elif kind is pg.Update:
            self._update(msg)  # type: ignore[arg-type]
        elif kind is pg.Delete:
            self._delete(msg)  # type: ignore[arg-type]
        elif kind is pg.Begin:
            self.begin = msg  # type: ignore[assignment]
            self.tx.clear()
        elif kind is pg.Commit:
            self._commit(msg)  # type: ignore[arg-type]
        elif kind is pg.Relation:
            self._relation(msg)  # type: ignore[arg-type]
        elif kind is pg.Truncate:
            self._truncate(msg)  # type: ignore[arg-type]
        elif kind is pg.Type:
            self.types.types.pop(msg.oid, None)  # type: ignore[union-attr]
        elif kind is pg.Message:
            self._message(msg)  # type: ignore[arg-type]

    def _message(self, msg: pg.Message) -> None:
        if self.watch is not None and msg.prefix == WATERMARK_PREFIX:
            self.marks.append(msg.content)

    # ---- relations --------------------------------------------------------------------------
    def _relation(self, rel: pg.Relation) -> None:
        if self.backfills is not None:
            self.backfills.relation(rel)  # may add the table to self.keyed
        if (rel.namespace, rel.name) == self.cfg.signal:
            self.signal_oid, self.signal_columns = rel.oid, [c.name for c in rel.columns]
        keyed = self.keyed.get((rel.namespace, rel.name))
        if keyed is None:
            self.encoders[rel.oid] = None
            self.transcoders.pop(rel.oid, None)
            return
        nulls = nullability(self.conn, rel.oid)
        # under REPLICA IDENTITY FULL pgoutput flags every column: a keyed table keeps its own key (the snapshot's)
        keys = key_names(self.conn, rel.oid) if keyed and rel.replica_identity == "f" else None
        columns = [
            ColumnInfo(
                c.name,
                self.types.get(c.type_oid),
                c.typmod,
                nulls.get(c.name, True),
                (c.name in keys) if keys is not None else c.is_key and keyed,
            )
            for c in rel.columns
        ]
        table = TableSchema.build(self.cfg.topic_prefix, rel.namespace, rel.name, columns)
        current = self.encoders.get(rel.oid)
        if current is not None and current.table == table:
            return  # same shape: its encoder and transcoder stay
        self.encoders[rel.oid] = encoder = self.register(table)
        fast = transcoder(encoder) if self.fast else None
        if fast is None:
            self.transcoders.pop(rel.oid, None)
        else:
            self.transcoders[rel.oid] = fast
        if current is not None:
            log.info("schema of %s changed: registered a new version for %s", table.qualified, table.topic)

    def register(self, table: TableSchema) -> RowEncoder:
        ids = register_table(self.registrar, table, self.cfg)
        self.sink.writer.learn(table, ids)
        return RowEncoder(table, ids.value, ids.key, self.cfg.format)

    # ---- rows -------------------------------------------------------------------------------
    def _lsn(self) -> int:
        return self.begin.final_lsn if self.begin else 0

    def _remember(self, enc: RowEncoder, key: bytes | None, texts: Sequence[Any]) -> None:
        if key is None or not enc.toastable:
            return
        for i, text in enc.large_values(texts):
            self.state.remember(enc.table.qualified, body(key), i, self._lsn(), text)

    def _transcode(self, kind: int, fast: Transcoder, buf: bytes) -> bool:
        """Insert, Update or Delete on the fast path; False leaves the message to the general path."""
        try:
            found = _fast_change(kind, fast, buf)
        except Exception:  # anything unusual is the general path's to handle or report
            return False
        if found is None:
            return False
        op, key, before, after, large = found
        t = fast.table
        if large and key is not None:
            lsn = self._lsn()
            for i, text in large:
                self.state.remember(t.qualified, body(key), i, lsn, text)
        self.tx.add(RowChange(op, t.schema, t.name, t.topic, key, before, after))
        self.fast_rows += 1
        return True

    def _insert(self, msg: pg.Insert) -> None:
        enc = self.encoders.get(msg.relation_oid)
        if enc is None:
            if msg.relation_oid == self.signal_oid and self.backfills is not None:
                self._signal(msg)
            return
        texts = list(msg.new)
        values = enc.convert(texts)
        key = enc.encode_key(values)
        self._remember(enc, key, texts)
        t = enc.table
        self.tx.add(RowChange("INSERT", t.schema, t.name, t.topic, key, None, enc.encode_value(values)))

    def _signal(self, msg: pg.Insert) -> None:
        assert self.backfills is not None
        row = {n: v if isinstance(v, str) else None for n, v in zip(self.signal_columns, msg.new, strict=False)}
        self.backfills.signal(row, self._lsn())

    def _update(self, msg: pg.Update) -> None:
        enc = self.encoders.get(msg.relation_oid)
        if enc is None:
            return
        texts = list(msg.new)
        old = list(msg.old) if msg.old is not None else None
        if pg.UNCHANGED in texts:
            texts = self._fill_unchanged(enc, texts, old if msg.old_kind == "O" else None)
        values = enc.convert(texts)
        key = enc.encode_key(values)
        self._remember(enc, key, texts)
        before = None
        if old is not None:
            old_values = enc.convert([None if v is pg.UNCHANGED else v for v in old])
            before = enc.encode_value(old_values) if msg.old_kind == "O" else enc.encode_key(old_values)
        t = enc.table
        self.tx.add(RowChange("UPDATE", t.schema, t.name, t.topic, key, before, enc.encode_value(values)))

    def _fill_unchanged(self, enc: RowEncoder, texts: list[Any], old: list[Any] | None) -> list[Any]:
        values = enc.convert([None if v is pg.UNCHANGED else v for v in texts])
        key = enc.encode_key(values)
        filled = list(texts)
        for i, text in enumerate(texts):
            if text is not pg.UNCHANGED:
                continue
            if old is not None and old[i] is not pg.UNCHANGED:
                filled[i] = old[i]
                continue
            cached = self.state.recall(enc.table.qualified, body(key), i, self._lsn()) if key else None
            filled[i] = cached if cached is not None else self._read_current(enc, texts, i)
        return filled

    def _read_current(self, enc: RowEncoder, texts: list[Any], index: int) -> str | None:
        """Last resort for an unchanged TOASTed value not in the cache: today's value from the table."""
        table = enc.table
        column = table.columns[index].name
        log.warning("%s.%s: unchanged TOAST value not cached; reading the current value", table.qualified, column)
        keys = [(table.columns[i].name, texts[i]) for i in table.key_indexes]
        query = sql.SQL("SELECT {}::text FROM {} WHERE {}").format(
            sql.Identifier(column),
            sql.Identifier(table.schema, table.name),
            sql.SQL(" AND ").join(sql.SQL("{} = %s").format(sql.Identifier(k)) for k, _ in keys),
        )
        with self.conn.cursor() as cur:
            cur.execute(query, [v for _, v in keys])
            row = cur.fetchone()
        self.conn.commit()
        return row[0] if row else None

    def _delete(self, msg: pg.Delete) -> None:
        enc = self.encoders.get(msg.relation_oid)
        if enc is None:
            return
        old_values = enc.convert([None if v is pg.UNCHANGED else v for v in msg.old])
        key = enc.encode_key(old_values)
        before = enc.encode_value(old_values) if msg.old_kind == "O" else None
        t = enc.table
        self.tx.add(RowChange("DELETE", t.schema, t.name, t.topic, key, before, None))

    def _truncate(self, msg: pg.Truncate) -> None:
        for oid in msg.relation_oids:
            enc = self.encoders.get(oid)
            if enc is not None:
                t = enc.table
                self.tx.add(RowChange("TRUNCATE", t.schema, t.name, t.topic, None, None, None))

    def _commit(self, msg: pg.Commit) -> None:
        xid = self.begin.xid if self.begin else 0
        if self.watch is not None:
            self.watch.commit(self.tx, xid, self.marks, msg)  # a chunk whose high watermark this is goes first
            self.marks.clear()
        if self.tx.spilled:
            log.info("large transaction %d: %d changes spilled to disk, sending them now", xid, len(self.tx))
        self.sink.emit_transaction(self.tx, msg.commit_lsn, msg.end_lsn, xid, msg.commit_time)
        self.tx.clear()
        self.begin = None
        self.last_commit_lsn, self.last_commit_time = msg.commit_lsn, msg.commit_time
        self.last_commit_seen = time.monotonic()


Found = tuple[str, bytes | None, bytes | None, bytes | None, list[tuple[int, str]] | None]


def _fast_change(kind: int, fast: Transcoder, buf: bytes) -> Found | None:
    """(op, key, before, after, large values) of an Insert/Update/Delete, or None."""
    flag = buf[5]
    if kind == INSERT:
        row = fast.row(buf, 6) if flag == NEW else None
        return None if row is None or row[3] != len(buf) else ("INSERT", row[1], None, row[0], row[2])
    pos = 6
    before = old_key = None
    if flag == KEY and fast.key is not None:
        found = fast.key(buf, 6)
        if found is None:
            return None
        before, pos = found
        old_key = before
    elif flag == OLD:
        old = fast.row(buf, 6)
        if old is None:
            return None
        before, old_key, _, pos = old
    elif kind == DELETE or flag != NEW:
        return None
    if kind == DELETE:
        return None if pos != len(buf) else ("DELETE", old_key, (before if flag == OLD else None), None, None)
    if flag != NEW:
        flag = buf[pos]
        pos += 1
    row = fast.row(buf, pos) if flag == NEW else None
    return None if row is None or row[3] != len(buf) else ("UPDATE", row[1], before, row[0], row[2])


class Loop:
    """Reads the slot until ``stop`` is set; confirms and checkpoints every status interval."""

    def __init__(
        self,
        cfg: CaptureConfig,
        repl: Connection,
        heartbeat_conn: Connection,
        streamer: Streamer,
        producer: ChangeProducer,
        state: State,
        confirmed: int,
        metrics: CaptureMetrics,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.kafka_seen = 0.0
        self.repl = repl
        self.heartbeat_conn = heartbeat_conn
        self.streamer = streamer
        self.producer = producer
        self.state = state
        self.confirmed = confirmed
        self.last_heartbeat = time.monotonic()
        self.last_status = 0.0
        self.checkpoints = 0
        self.last_data_start = 0  # WAL position of the last message received
        self._events_at = (time.monotonic(), 0)

    def run(self, start_lsn: int, stop: threading.Event) -> None:
        cur: Any = self.repl.cursor()  # a ReplicationCursor (untyped in psycopg2's stubs)
        cur.start_replication(
            slot_name=self.cfg.slot,
            decode=False,
            start_lsn=start_lsn,
            status_interval=max(self.cfg.status_interval, 1.0),
            options={"proto_version": "1", "publication_names": self.cfg.publication, "messages": "true"},
        )
        log.info("streaming from slot %s at %s", self.cfg.slot, lsn_text(start_lsn or self.confirmed),
                 extra=facts(slot=self.cfg.slot, lsn=start_lsn or self.confirmed))  # fmt: skip
        self.metrics.stream_started()
        # The stream allocates millions of short-lived, acyclic objects: keep the cyclic collector
        # from rescanning everything built at start-up, and from running every 700 allocations
        # (measured: +7% changes/s on the benchmark backlog).
        gc.collect()
        gc.freeze()
        gc.set_threshold(100_000, 50, 100)
        handled = 0
        while not stop.is_set():
            msg = cur.read_message()
            if msg is not None:
                self.streamer.handle(msg.payload)
                self.last_data_start = msg.data_start
                handled += 1
                if handled % 1000:
                    continue
                self.backfill_step()
            elif not self.backfill_step():
                select.select([self.repl.fileno(), *self.wakers()], [], [], 0.2)
            self.housekeeping(cur)
        self.producer.flush()
        self.housekeeping(cur, force=True)

    def backfill_step(self) -> bool:
        """A backfill's next chunk, when one is due (True if one was handed over or taken)."""
        backfills = self.streamer.backfills
        return backfills is not None and backfills.step()

    def wakers(self) -> list[int]:
        backfills = self.streamer.backfills
        return [backfills.waker()] if backfills is not None else []

    def housekeeping(self, cur: Any, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.kafka_seen >= KAFKA_EVERY:
            self.kafka_seen = now
            self.producer.poll(0)  # its statistics (broker connections) come with a poll
            self.metrics.watch_producer(self.producer, now)
        if not force and now - self.last_status < self.cfg.status_interval:
            return
        self.last_status = now
        acked = self.producer.acked_lsn()
        if acked is not None and acked > self.confirmed:
            self.confirm(cur, acked)
        if self.streamer.backfills is not None:
            self.streamer.backfills.housekeeping(acked)
        if self.settled(self.confirmed) and cur.wal_end > self.confirmed:
            self.confirm(cur, cur.wal_end)  # nothing for us up to the server's position: follow it
        if self.cfg.heartbeat_interval > 0:
            idle = now - max(self.streamer.last_commit_seen, self.last_heartbeat)
            if idle >= self.cfg.heartbeat_interval:
                self.heartbeat()
        self.report(cur, now)

    def report(self, cur: Any, now: float) -> None:
        """Metrics once per status interval (``capture.metrics``): counts, positions, the last commit (the
        slot is ``capture.slotwatch``'s, Kafka ``housekeeping``'s)."""
        m, s = self.metrics, self.streamer
        m.count(s.sink, self.producer)
        m.positions(self.confirmed, cur.wal_end)
        m.commit_seen(s.last_commit_time, s.last_commit_seen)
        for backfill in s.backfills.progress() if s.backfills is not None else ():
            m.snapshot_rows("backfill", backfill.table, backfill.rows, backfill.estimate)
        m.beat()

    def settled(self, confirmed: int) -> bool:
        """With ``confirmed`` told to the slot, every message received is confirmed and no transaction
        is open (the module's contract)."""
        return confirmed >= self.last_data_start and self.streamer.begin is None

    def confirm(self, cur: Any, lsn: int) -> None:
        """Checkpoint first, then tell the slot: a crash in between replays, never skips."""
        now = time.monotonic()
        events = self.streamer.sink.events
        then, before = self._events_at
        rate = (events - before) / max(now - then, 1e-6)
        self._events_at = (now, events)
        s = self.streamer
        self.state.checkpoint(lsn, s.last_commit_lsn, s.last_commit_time, events, rate, settled=self.settled(lsn))
        cur.send_feedback(write_lsn=lsn, flush_lsn=lsn, apply_lsn=lsn, force=True)
        self.confirmed = lsn
        self.checkpoints += 1
        if self.checkpoints % 100 == 0:
            self.state.prune(lsn)

    def heartbeat(self) -> None:
        self.last_heartbeat = time.monotonic()
        try:
            with self.heartbeat_conn.cursor() as cur:
                cur.execute("SELECT pg_logical_emit_message(true, %s, now()::text)", (HEARTBEAT_PREFIX,))
            self.heartbeat_conn.commit()
            self.metrics.heartbeats.inc()
        except psycopg2.Error as exc:
            if self.heartbeat_conn.closed:
                raise  # the server went away: the session ends and is retried
            self.heartbeat_conn.rollback()
            log.warning("heartbeat failed (the slot may fall behind while captured tables are idle): %s", exc)
