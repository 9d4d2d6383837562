"""Changes on their way to the raw topic: envelopes, positions and bounded transaction buffers.

Promise: ``ChangeSink`` gives every change its source position — commit LSN, xid,
commit time, 0-based position in its transaction and the transaction's size — and
sends it through the producer in order (a backfill's chunk is a transaction of its own
at its high watermark's commit). ``TxBuffer`` holds one transaction's
changes until its commit (only then is its size known), spilling to a temporary
file past a byte limit so a huge transaction does not grow memory without bound.
"""

from __future__ import annotations

import pickle
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, NamedTuple

from capture.encoder import ChangeWriter
from capture.jsonformat import JsonChangeWriter
from capture.producer import ChangeProducer
from tables.catalog import TableSchema

UNIX_FROM_PG_MICROS = 946_684_800_000_000  # 2000-01-01 minus 1970-01-01, in µs
Tally = Counter[tuple[str, str, str]]  # changes by (schema, table, op): what the metrics count


def snapshot_commit_lsn(consistent_point: int) -> int:
    """The commit LSN a snapshot's records carry: one below the slot's consistent point. The snapshot holds every
    transaction whose commit record starts before that point, and the stream every one from it on, the first
    of which may start at the point itself (a commit right after the slot's ``running_xacts`` record: 19 of 100
    slots made under a writer with multi-statement transactions). One below keeps ``commit_lsn`` strictly
    increasing from the snapshot to the stream, so a cut at the snapshot never covers a streamed transaction."""
    return consistent_point - 1


class RowChange(NamedTuple):
    """One change before its transaction's commit gives it a position (a tuple: made per change)."""

    op: str
    schema: str
    table: str
    topic: str
    key: bytes | None
    before: bytes | None
    after: bytes | None


class ChangeSink:
    def __init__(self, writer: ChangeWriter | JsonChangeWriter, producer: ChangeProducer | None) -> None:
        """``producer`` None: a snapshot worker whose messages the Copier sends (``snapshot_head``)."""
        self.writer = writer
        self._producer = producer
        self._snapshot_lsn = 0
        self._snapshot_tx = b""
        self._zero = b""
        self._position = 0
        self._stride = 1
        self.events = 0
        self.tally: Tally = Counter()  # snapshot READs and retractions since capture.metrics last took them
        self.transactions = 0

    @property
    def producer(self) -> ChangeProducer:
        if self._producer is None:
            raise RuntimeError("this sink has no producer: its snapshot rows are sent by the Copier")
        return self._producer

    def _send(self, change: RowChange, transaction: bytes, position: int, size: bytes) -> None:
        c = change
        value = self.writer.encode(
            c.op, c.schema, c.table, c.topic, transaction, position, size, c.key, c.before, c.after
        )
        self.producer.send(self.writer.encode_key(c.schema, c.table), value)

    # ---- snapshot ------------------------------------------------------------------------
    def start_snapshot(self, lsn: int, time_us: int, *, first: int = 0, stride: int = 1) -> None:
        """Snapshot rows of the slot whose consistent point is ``lsn`` (``snapshot_commit_lsn``) get positions
        first, first + stride, ...: unique across ``stride`` workers."""
        self._snapshot_lsn, self._position, self._stride = lsn, first, stride
        self._snapshot_tx = self.writer.transaction(snapshot_commit_lsn(lsn), 0, time_us)
        self._zero = self.writer.size(0)

    def next_position(self) -> int:
        return self._position

    def snapshot_emitter(self, table: TableSchema) -> Callable[[bytes | None, bytes], None]:
        """``emit(key, after)`` of one table's snapshot rows (READ changes); positions count up by
        the stride (one sink per worker process)."""
        encode = self.writer.read_encoder(table.schema, table.name, table.topic, self._snapshot_tx, self._zero)
        kafka_key = self.writer.encode_key(table.schema, table.name)
        send = self.producer.send

        def emit(key: bytes | None, after: bytes) -> None:
            position = self._position
            self._position = position + self._stride
            send(kafka_key, encode(position, key, after))
            self.events += 1

        return emit

    def snapshot_head(self, table: TableSchema) -> tuple[bytes, bytes, bytes, int, int]:
        """(Kafka key, value head, tx size, next position, stride) of one table's READ changes, for a
        writer of whole batches (``snapshot._copy_chunk``); ``skip(rows)`` then accounts for them."""
        if not isinstance(self.writer, ChangeWriter):
            raise TypeError("whole READ batches are written in the Avro format only")
        head = self.writer.read_head(table.schema, table.name, table.topic, self._snapshot_tx)
        return self.writer.encode_key(table.schema, table.name), head, self._zero, self._position, self._stride

    def skip(self, rows: int) -> None:
        """``rows`` READ changes were written with the positions ``snapshot_head`` gave."""
        self._position += rows * self._stride
        self.events += rows

    def retract(self, table: TableSchema, keys: Iterable[bytes], position: int) -> int:
        """A DELETE of each of ``keys`` as part of the snapshot, positions from ``position`` (``capture.retract``);
        returns the next position. Their tx_size is 0, like READ rows: none ends a transaction."""
        for key in keys:
            change = RowChange("DELETE", table.schema, table.name, table.topic, key, None, None)
            self._send(change, self._snapshot_tx, position, self._zero)
            position += 1
            self.events += 1
            self.tally[(table.schema, table.name, "DELETE")] += 1
        return position

    def end_snapshot(self, rows: int, position: int) -> None:
        """SNAPSHOT_END: the snapshot is complete; its tx_size is the number of rows."""
        marker = RowChange("SNAPSHOT_END", "", "", "", None, None, None)
        self._send(marker, self._snapshot_tx, position, self.writer.size(rows))
        self.producer.mark(self._snapshot_lsn)

    # ---- backfills ------------------------------------------------------------------------
    def prepare_chunks(self) -> None:
        """The chunks' producer (``emit_chunk``) is made now, at a session's start, not when a backfill starts:
        librdkafka's idempotent producer sends nothing for about 0.5 s after it is made (its producer id first),
        and every backfill's second chunk waited that long for the first one's acknowledgement, the stream with it
        (``./dev bench backfill``: 0.4-0.5 s of ~2 s)."""
        if isinstance(self.writer, ChangeWriter):
            self.producer.chunk_sender()

    def emit_chunk(self, op: str, table: TableSchema, rows: list[tuple[bytes | None, bytes | None]],
                   commit_lsn: int, xid: int, pg_time: int, backfill: int) -> int:  # fmt: skip
        """One chunk of a backfill as one transaction at its high watermark's commit: READ rows (or, for a
        retraction, DELETEs of keys), positions from 0, each naming the ``backfill``. Returns the count."""
        if not rows:
            return 0
        transaction = self.writer.transaction(commit_lsn, xid, pg_time + UNIX_FROM_PG_MICROS)
        t = table
        if isinstance(self.writer, ChangeWriter) and (sender := self.producer.chunk_sender()) is not None:
            parts = self.writer.chunk_parts(op, t.schema, t.name, t.topic, transaction, rows, backfill)
            self.producer.send_chunk(sender, *parts)
        else:
            self.producer.send_all(self.writer.chunk(op, t.schema, t.name, t.topic, transaction, rows, backfill))
        self.events += len(rows)
        return len(rows)

    # ---- streaming -----------------------------------------------------------------------
    def emit_transaction(self, changes: TxBuffer, commit_lsn: int, end_lsn: int, xid: int, pg_time: int) -> None:
        transaction = self.writer.transaction(commit_lsn, xid, pg_time + UNIX_FROM_PG_MICROS)
        count = len(changes)
        self.producer.send_all(self.writer.records(changes, transaction, self.writer.size(count)))
        self.events += count
        self.transactions += 1  # its changes are counted by the writer (``take_counts``)
        self.producer.mark(end_lsn)


class TxBuffer:
    """One transaction's changes, in memory up to ``limit`` bytes, then in a spill file."""

    def __init__(self, limit: int, spill_dir: Path) -> None:
        self.limit = limit
        self.spill_dir = spill_dir
        self.items: list[RowChange] = []
        self.bytes = 0
        self.count = 0
        self.spill: IO[bytes] | None = None

    def add(self, change: RowChange) -> None:
        self.count += 1
        if self.spill is not None:
            pickle.dump(change, self.spill, protocol=pickle.HIGHEST_PROTOCOL)
            return
        self.items.append(change)
        self.bytes += 64 + len(change.after or b"") + len(change.key or b"") + len(change.before or b"")
        if self.bytes > self.limit:
            self.spill_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.spill = tempfile.TemporaryFile(dir=self.spill_dir, prefix="tx-")  # noqa: SIM115 - closed by clear()
            for item in self.items:
                pickle.dump(item, self.spill, protocol=pickle.HIGHEST_PROTOCOL)
            self.items = []

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[RowChange]:
        if self.spill is None:
            yield from self.items
            return
        self.spill.seek(0)
        for _ in range(self.count):
            yield pickle.load(self.spill)  # noqa: S301 - our own spill file, written just above

    def clear(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None
        self.items = []
        self.bytes = 0
        self.count = 0

    @property
    def spilled(self) -> bool:
        return self.spill is not None
