"""Reading one planned slice of a topic into Arrow batches, on a Spark executor.

Promise: ``SliceReader.read`` reads offsets ``start`` to ``end - 1`` of one partition and
stops there — at the planned end, or at partition EOF when compaction or transaction
markers left the last offsets empty — never later, whatever is written meanwhile.
Values are decoded from the Confluent wire format with the writer's schema (fetched
once per id per executor process and cached) resolved to the topic's newest schema,
so a topic whose schema changed reads as its newest version (a decimal written under another
scale as the newest scale means it: ``analytics.rescale``). ``changes`` mode gives a
row per message (a tombstone is a ``DELETE`` row holding only the key's columns);
``latest`` keeps each key's last message by offset and drops tombstones. Metadata
columns: ``_op`` (changes mode, or with ``metadata``), ``_partition``, ``_offset``,
``_commit_lsn`` (with ``metadata``). A record no registered schema decodes fails the
task with a ``SourceError`` naming topic, partition and offset.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fastavro
import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from pyspark.sql import types as T

from analytics.errors import SourceError, SourceUnavailable
from analytics.plan import Request, Slice, ValueSchema
from analytics.rescale import Convert, rescaler
from analytics.types import Field, arrow_schema, column_array, record_fields
from tables.avro import plain
from tables.errors import RetryableError
from tables.kafka import FetchWait, Stalled, StallWatch, reader
from tables.registry import Registry
from tables.wire import HEADER_LSN, HEADER_OP, UndecodableMessage, body, schema_id

log = logging.getLogger("headwater.analytics")
BATCH_ROWS = 20_000  # rows per Arrow batch handed to Spark
POLL_MESSAGES = 5_000
META = {"_op": T.StringType(), "_partition": T.IntegerType(), "_offset": T.LongType(), "_commit_lsn": T.LongType()}
_WRITERS: dict[tuple[str, int], tuple[Any, Any]] = {}  # (registry, schema id) -> (parsed plain schema, the schema)


def meta_columns(req: Request) -> list[str]:
    if req.metadata:
        return list(META)
    return ["_op"] if req.mode == "changes" else []


def spark_schema(req: Request, fields: list[Field]) -> T.StructType:
    """The DataFrame's columns: the value record's fields, then the metadata columns."""
    clash = [f.name for f in fields if f.name in META]
    if clash:
        raise SourceError(f"the value has a field named {clash[0]}, which a metadata column also uses",
                          topic=req.topic, hint="read it with metadata=false")  # fmt: skip
    columns = [T.StructField(f.name, f.spark, True) for f in fields]
    columns += [T.StructField(name, META[name], name != "_op") for name in meta_columns(req)]
    return T.StructType(columns)


@dataclass
class Row:
    offset: int
    value: dict[str, Any]
    op: str
    lsn: int | None


class SliceReader:
    """Decodes the messages of a slice (picklable: built on the driver, used on executors)."""

    def __init__(self, req: Request, value: ValueSchema) -> None:
        self.req = req
        self.value = value
        self.fields: list[Field] = record_fields(value.schema)
        self.schema = spark_schema(req, self.fields)
        self.arrow = arrow_schema(self.schema)
        self._reader_schema: Any = None
        self._rescalers: dict[int, Convert | None] = {}  # writer schema id -> its decimals to the newest's scales

    # ---- decoding -------------------------------------------------------------------------
    def _writer(self, schema_id: int, where: Slice, offset: int) -> tuple[Any, Any]:
        cached = _WRITERS.get((self.req.registry, schema_id))
        if cached is None:
            try:
                schema = Registry(self.req.registry).schema(schema_id)
            except RetryableError as exc:
                raise SourceUnavailable(exc.message, topic=where.topic, partition=where.partition, offset=offset,
                                        hint=self.req.registry_hint) from exc  # fmt: skip
            except UndecodableMessage as exc:
                raise SourceError(f"schema id {schema_id} is not in the registry {self.req.registry}",
                                  topic=where.topic, partition=where.partition, offset=offset,
                                  hint="the record was written against another registry, or its schema was "
                                       "deleted") from exc  # fmt: skip
            cached = _WRITERS[(self.req.registry, schema_id)] = (fastavro.parse_schema(plain(schema)), schema)
        return cached

    def decode(self, data: bytes, where: Slice, offset: int, *, resolve: bool) -> dict[str, Any]:
        """A framed Avro record as raw values (``resolve``: read as the topic's newest value schema)."""
        try:
            writer_id = schema_id(data)
        except UndecodableMessage as exc:
            raise SourceError(exc.message, topic=where.topic, partition=where.partition, offset=offset) from exc
        writer, original = self._writer(writer_id, where, offset)
        if self._reader_schema is None:
            self._reader_schema = fastavro.parse_schema(plain(self.value.schema))
        newest = self._reader_schema if resolve and writer_id != self.value.schema_id else None
        try:
            out = fastavro.schemaless_reader(io.BytesIO(body(data)), writer, newest)
        except (EOFError, ValueError, IndexError, KeyError, UnicodeDecodeError, TypeError) as exc:
            raise SourceError(f"the Avro body does not match schema {writer_id}: {exc!r}",
                              topic=where.topic, partition=where.partition, offset=offset) from exc  # fmt: skip
        if not isinstance(out, dict):
            raise SourceError(f"schema {writer_id} is not a record", topic=where.topic, partition=where.partition,
                              offset=offset)  # fmt: skip
        if writer_id not in self._rescalers:  # a key's columns too: a tombstone's row is its key
            self._rescalers[writer_id] = rescaler(original, self.value.schema)
        rescale = self._rescalers[writer_id]
        return out if rescale is None else dict(rescale(out))

    def row(self, msg: Message, where: Slice) -> Row:
        offset = int(msg.offset() or 0)
        op, lsn = _headers(msg.headers())
        data = msg.value()
        if data is not None:
            return Row(offset, self.decode(data, where, offset, resolve=True), op or "UPSERT", lsn)
        key = msg.key()
        values = self.decode(key, where, offset, resolve=False) if key is not None else {}
        return Row(offset, values, op if op in ("DELETE", "TRUNCATE") else "DELETE", lsn)

    # ---- reading --------------------------------------------------------------------------
    def read(self, where: Slice) -> Iterator[pa.RecordBatch]:
        messages = self._messages(where)
        if self.req.mode == "latest":
            yield from self._batches(self._latest(messages, where), where.partition)
            return
        yield from self._batches((self.row(m, where) for m in messages), where.partition)

    def _latest(self, messages: Iterator[Message], where: Slice) -> Iterator[Row]:
        last: dict[bytes | None, Message] = {}
        for msg in messages:
            last[msg.key()] = msg
        for msg in sorted(last.values(), key=lambda m: int(m.offset() or 0)):
            if msg.value() is not None:
                yield self.row(msg, where)

    def _messages(self, where: Slice) -> Iterator[Message]:
        """``_until_end``, by a new consumer from where the last stood when one stalls (with a longer fetch wait
        when its fetches came back empty below the end: the local broker on a partition of many batches)."""
        wait, at = FetchWait(self.req.kafka), where.start
        deadline = time.monotonic() + self.req.timeout
        while True:
            consumer = self._consumer(where, at, wait)
            try:
                for msg in _until_end(consumer, where, at, deadline, wait):
                    at = int(msg.offset() or 0) + 1
                    yield msg
                return
            except Stalled as exc:
                log.warning("%s: reading on from offset %d with a new consumer", exc, at)
            finally:
                consumer.close()

    def _consumer(self, where: Slice, at: int, wait: FetchWait) -> Consumer:
        try:
            consumer = reader(wait.applied(self.req.kafka))
            consumer.assign([TopicPartition(where.topic, where.partition, at)])
        except KafkaException as exc:
            raise SourceError(f"cannot read: {exc}", topic=where.topic, partition=where.partition) from exc
        return consumer

    def _batches(self, rows: Iterator[Row], partition: int) -> Iterator[pa.RecordBatch]:
        chunk: list[Row] = []
        for row in rows:
            chunk.append(row)
            if len(chunk) >= BATCH_ROWS:
                yield self.batch(chunk, partition)
                chunk = []
        if chunk:
            yield self.batch(chunk, partition)

    def batch(self, rows: list[Row], partition: int) -> pa.RecordBatch:
        kinds = self.arrow.types  # the value's fields, then the metadata columns
        arrays = [column_array([r.value.get(f.name) for r in rows], f, kind)
                  for f, kind in zip(self.fields, kinds, strict=False)]  # fmt: skip
        meta: dict[str, Callable[[], list[Any]]] = {
            "_op": lambda: [r.op for r in rows],
            "_partition": lambda: [partition] * len(rows),
            "_offset": lambda: [r.offset for r in rows],
            "_commit_lsn": lambda: [r.lsn for r in rows],
        }
        names = meta_columns(self.req)
        arrays += [pa.array(meta[name](), kind) for name, kind in zip(names, kinds[len(self.fields) :], strict=True)]
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow)


def _headers(headers: Any) -> tuple[str | None, int | None]:
    """(operation, commit LSN) from Headwater's ``hw.op`` / ``hw.lsn`` headers, each None when absent.

    Not ``streams.fanout.header_lsn``: that one reads an absent LSN as 0, and ``_commit_lsn`` must tell
    "no header" (null) from a header.
    """
    op = lsn = None
    for name, value in headers or ():
        if name == HEADER_OP and value:
            op = value.decode()
        elif name == HEADER_LSN and value:
            lsn = int(value)
    return op, lsn


def _until_end(consumer: Consumer, where: Slice, at: int, deadline: float, wait: FetchWait) -> Iterator[Message]:
    """Messages from ``at`` to ``where.end - 1``; stops at partition EOF if the end is a gap; ``Stalled``
    when the consumer stalls below it."""
    watch = StallWatch(until_eof=True, wait=wait)
    while at < where.end:
        if time.monotonic() > deadline:
            raise SourceUnavailable(f"did not reach the planned end {where.end} in time",
                                    topic=where.topic, partition=where.partition, offset=at,
                                    hint="raise the 'timeout' option or check the broker")  # fmt: skip
        messages = consumer.consume(min(POLL_MESSAGES, where.end - at), 0.5)  # returns once it has them all
        if not messages:
            watch.check(consumer, {(where.topic, where.partition)})
            continue
        watch.seen()
        for msg in messages:
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return  # everything before the end was read: the rest is a gap
                raise SourceUnavailable(f"Kafka error: {error}", topic=where.topic, partition=where.partition,
                                        offset=at)  # fmt: skip
            at = int(msg.offset() or 0)
            if at >= where.end:
                return
            yield msg
            at += 1
