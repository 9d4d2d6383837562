"""Rows to Avro in the Confluent wire format, with the table's registered schema ids.

Promise: ``RowEncoder`` converts a row of PostgreSQL text values with the table's
converters and writes it with fastavro, prefixed by magic byte 0 and the 4-byte
schema id. A value the Avro type cannot hold raises ``UnsupportedValueError`` naming
table and column. ``ChangeWriter`` writes raw-topic records around the framed images;
``NestedChangeWriter`` (``raw_images = "nested"``) writes the same changes with each image
nested as its table's record, in the change record of the image's table shape (learned when
the shape is registered: ``learn``). Capture holds images framed everywhere else.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import fastavro

from capture._copier import envelopes
from capture.errors import UnsupportedValueError
from capture.jsonformat import Change, JsonChangeWriter, JsonRowWriter
from capture.schemas import Ids
from tables.avro import compile_schema, long_bytes
from tables.catalog import TableSchema
from tables.change import CHANGE_KEY_SCHEMA, OPS
from tables.types import (
    UnsupportedValue,
    parse_bool,
    parse_date,
    parse_interval,
    parse_money,
    parse_time,
    parse_timestamp,
)
from tables.wire import frame

Text = str | None
Image = tuple[bytes | None, bytes | None]  # (key, after) of a backfill's row
ChunkParts = tuple[bytes, bytes, bytes, list[Image], bytes, bool]  # key, head, size, rows, tail, nested
FIXED_SIZE = frozenset({int, float, parse_bool, parse_date, parse_time, parse_timestamp, parse_money, parse_interval})


TOAST_MIN = 256  # values this long are remembered: they may be stored out of line


class AvroWriter:
    """One schema and its registered id: ``encode(value)`` gives framed bytes."""

    def __init__(self, schema: dict[str, Any], schema_id: int) -> None:
        fastavro.parse_schema(json.loads(json.dumps(schema)))  # refuse an invalid schema early
        self._encode = compile_schema(schema)
        self.prefix = frame(schema_id)

    def encode(self, value: Any) -> bytes:
        return self.prefix + self._encode(value)


class RowEncoder:
    """Encodes rows of one table shape (value and key); rows are value lists in column order."""

    def __init__(self, table: TableSchema, value_id: int, key_id: int | None, fmt: str = "avro") -> None:
        self.table = table
        self.value: AvroWriter | JsonRowWriter
        self.key: AvroWriter | JsonRowWriter | None
        if fmt == "json":
            columns = table.columns
            self.value = JsonRowWriter([c.name for c in columns], [c.pgtype for c in columns])
            keys = [c for c in columns if c.is_key]
            self.key = JsonRowWriter([c.name for c in keys], [c.pgtype for c in keys]) if keys else None
        else:
            self.value = AvroWriter(table.value_schema, value_id)
            self.key = AvroWriter(table.key_schema, key_id) if table.key_schema and key_id is not None else None
        self.key_indexes = table.key_indexes
        self.converters = table.converters
        # columns that may hold values long enough to be TOASTed (not fixed-size types)
        self.toastable = tuple(i for i, conv in enumerate(self.converters) if conv not in FIXED_SIZE)

    def convert(self, texts: Sequence[Any]) -> list[Any]:
        try:
            return [None if text is None else conv(text) for text, conv in zip(texts, self.converters, strict=True)]
        except (UnsupportedValue, ValueError, ArithmeticError) as exc:
            raise UnsupportedValueError(self.table.qualified, self._culprit(texts), str(exc)) from exc

    def _culprit(self, texts: Sequence[Text]) -> str:
        for i, (text, conv) in enumerate(zip(texts, self.converters, strict=True)):
            try:
                if text is not None:
                    conv(text)
            except (UnsupportedValue, ValueError, ArithmeticError):
                return self.table.columns[i].name
        return "?"

    def encode_value(self, values: Sequence[Any]) -> bytes:
        try:
            return self.value.encode(values)
        except (ValueError, TypeError, KeyError, struct.error, OverflowError) as exc:
            raise UnsupportedValueError(self.table.qualified, "?", f"cannot encode row: {exc!r}") from exc

    def large_values(self, texts: Sequence[Text]) -> list[tuple[int, str]]:
        """(column index, text) of values long enough to be stored out of line."""
        return [(i, t) for i in self.toastable if (t := texts[i]) is not None and len(t) >= TOAST_MIN]

    def encode_key(self, values: Sequence[Any]) -> bytes | None:
        """The key record from a full row (or from a key-only old tuple, same positions)."""
        if self.key is None:
            return None
        return self.key.encode([values[i] for i in self.key_indexes])


def _optional_bytes(data: bytes | None) -> bytes:
    return b"\x00" if data is None else b"\x02" + long_bytes(len(data)) + data


NO_BACKFILL = b"\x00"  # the record's fields after ``after``: backfill = null


def backfill_tail(backfill: int | None) -> bytes:
    """The record's fields after ``after``: the ``backfill`` number, or null."""
    return NO_BACKFILL if backfill is None else b"\x02" + long_bytes(backfill)


class ChangeWriter:
    """Encodes raw-topic keys and values (``tables.change`` schemas); per-table and per-transaction
    parts are computed once."""

    nested = False  # row images as framed bytes

    def __init__(self, key_id: int, value_id: int) -> None:
        self.key_id, self.value_id = key_id, value_id
        self.key = AvroWriter(CHANGE_KEY_SCHEMA, key_id)
        self.prefix = frame(value_id)
        self._ops = {op: long_bytes(i) for i, op in enumerate(OPS)}
        self._keys: dict[tuple[str, str], bytes] = {}
        # (op, schema, table, topic[, frame]) -> (Kafka key, value head, [changes written by ``records`` since counted])
        self._heads: dict[tuple[str | bytes, ...], tuple[bytes, bytes, list[int]]] = {}

    def learn(self, table: TableSchema, ids: Ids) -> None:
        """A table shape was registered (its change record matters only to nested images)."""

    def encode_key(self, schema: str, table: str) -> bytes:
        found = self._keys.get((schema, table))
        if found is None:
            found = self._keys[(schema, table)] = self.key.encode([schema, table])
        return found

    @staticmethod
    def transaction(commit_lsn: int, xid: int, commit_time: int) -> bytes:
        return long_bytes(commit_lsn) + long_bytes(xid) + long_bytes(commit_time)

    @staticmethod
    def size(count: int) -> bytes:
        return long_bytes(count)

    def _head(self, op: str, schema: str, table: str, topic: str, prefix: bytes | None = None
              ) -> tuple[bytes, bytes, list[int]]:  # fmt: skip
        """(Kafka key, the value's bytes up to the transaction, a count) of one op on one table (``prefix``: the
        frame of the change record, when not the writer's own)."""
        ident: tuple[str | bytes, ...] = (op, schema, table, topic) if prefix is None else (op, schema, table, topic,
                                                                                           prefix)  # fmt: skip
        found = self._heads.get(ident)
        if found is None:
            head = (self.prefix if prefix is None else prefix) + self._ops[op]
            for text in (schema, table, topic):
                data = text.encode()
                head += long_bytes(len(data)) + data
            found = self._heads[ident] = (self.encode_key(schema, table), head, [0])
        return found

    def take_counts(self) -> Counter[tuple[str, str, str]]:
        """Changes ``records`` wrote by (schema, table, op) since the last call (counted at ~40 ns a change)."""
        out: Counter[tuple[str, str, str]] = Counter()
        for (op, schema, table, *_), (_, _, cell) in self._heads.items():
            if cell[0]:
                out[(str(schema), str(table), str(op))] += cell[0]
                cell[0] = 0
        return out

    def encode(self, op: str, schema: str, table: str, topic: str, transaction: bytes, position: int,
               size: bytes, key: bytes | None, before: bytes | None, after: bytes | None,
               backfill: int | None = None) -> bytes:  # fmt: skip
        return b"".join(
            (self._head(op, schema, table, topic)[1], transaction, long_bytes(position), size, _optional_bytes(key),
             _optional_bytes(before), _optional_bytes(after), backfill_tail(backfill))
        )  # fmt: skip

    def read_head(self, schema: str, table: str, topic: str, transaction: bytes) -> bytes:
        """A READ change's bytes before its position (op, table, topic, transaction)."""
        return self._head("READ", schema, table, topic)[1] + transaction

    def read_encoder(self, schema: str, table: str, topic: str, transaction: bytes,
                     size: bytes) -> Callable[[int, bytes | None, bytes], bytes]:  # fmt: skip
        """``encode(position, key, after)`` of one table's READ changes (the snapshot's hot path)."""
        head = self.read_head(schema, table, topic, transaction)

        def encode(position: int, key: bytes | None, after: bytes) -> bytes:
            return b"".join(
                (head, long_bytes(position), size, b"\x00" if key is None else b"\x02" + long_bytes(len(key)) + key,
                 b"\x00\x02", long_bytes(len(after)), after, NO_BACKFILL)
            )  # fmt: skip

        return encode

    def records(self, changes: Iterable[Change], transaction: bytes, size: bytes,
                backfill: int | None = None) -> Iterator[tuple[bytes, bytes]]:  # fmt: skip
        """(Kafka key, value) of each change of one transaction, positions from 0: ``encode`` per
        change, with the per-table parts looked up once per change and no call per field."""
        heads, tail = self._heads, backfill_tail(backfill)
        for position, (op, schema, table, topic, key, before, after) in enumerate(changes):
            found = heads.get((op, schema, table, topic)) or self._head(op, schema, table, topic)
            found[2][0] += 1
            yield found[0], b"".join(
                (found[1], transaction, long_bytes(position), size,
                 b"\x00" if key is None else b"\x02" + long_bytes(len(key)) + key,
                 b"\x00" if before is None else b"\x02" + long_bytes(len(before)) + before,
                 b"\x00" if after is None else b"\x02" + long_bytes(len(after)) + after, tail)
            )  # fmt: skip

    def chunk(self, op: str, schema: str, table: str, topic: str, transaction: bytes, rows: list[Image],
              backfill: int) -> Iterator[tuple[bytes, bytes]]:  # fmt: skip
        """(Kafka key, value) of a backfill chunk's changes (``rows``: key and after images), positions from 0:
        what ``records`` writes for them, by the compiled ``envelopes``."""
        kafka_key, head, size, rows, tail, nested = self.chunk_parts(op, schema, table, topic, transaction, rows,
                                                                     backfill)  # fmt: skip
        return zip(repeat(kafka_key), envelopes(head, size, rows, tail, nested))

    def chunk_parts(self, op: str, schema: str, table: str, topic: str, transaction: bytes, rows: list[Image],
                    backfill: int) -> ChunkParts:  # fmt: skip
        """(Kafka key, head, size, rows, tail, nested) of a backfill chunk's changes, counted: what ``envelopes``
        (or ``send_envelopes``) writes ``chunk``'s values from."""
        kafka_key, head, count = self._head(op, schema, table, topic)
        count[0] += len(rows)
        return kafka_key, head + transaction, self.size(len(rows)), rows, backfill_tail(backfill), False


class Shape(NamedTuple):
    """A table shape's change record (nested images): its frame, and the frame of the table's key schema."""

    prefix: bytes
    key_frame: bytes | None


KEY_BRANCH, ROW_BRANCH = b"\x04", b"\x02"  # ``before``: ["null", value record, key record]


class NestedChangeWriter(ChangeWriter):
    """``raw_images = "nested"``: the same changes as ``ChangeWriter``, each in the change record of its table
    shape (``tables.change.nested_change_schema``), its images as records: union branch and Avro body, without
    frame or length. The shape is the one whose value (else key) schema framed the image; changes of no table
    (SNAPSHOT_END) are the writer's own marker record (``value_id``)."""

    nested = True

    def __init__(self, key_id: int, value_id: int) -> None:
        super().__init__(key_id, value_id)
        self._by_value: dict[bytes, Shape] = {}  # value frame -> shape
        self._by_key: dict[tuple[str, str, bytes | None], Shape] = {}  # (schema, table, key frame) -> latest shape
        self._latest: dict[tuple[str, str], Shape] = {}
        self._marker = Shape(self.prefix, None)

    def learn(self, table: TableSchema, ids: Ids) -> None:
        if ids.change is None:
            raise RuntimeError(f"no nested change schema registered for {table.qualified}")
        key = None if ids.key is None else frame(ids.key)
        shape = self._by_value[frame(ids.value)] = Shape(frame(ids.change), key)
        self._by_key[(table.schema, table.name, key)] = self._latest[(table.schema, table.name)] = shape

    def shape(self, schema: str, table: str, key: bytes | None, before: bytes | None, after: bytes | None) -> Shape:
        """The table shape whose change record holds these images (framed as capture holds them)."""
        found = None
        if after is not None or before is not None:
            found = self._by_value.get((after if after is not None else before)[:5])  # type: ignore[index]
        if found is None:
            found = self._by_key.get((schema, table, None if key is None else key[:5])) or self._latest.get(
                (schema, table)
            )
        if found is None:
            if schema or table:
                raise RuntimeError(f"no nested change schema learned for {schema}.{table}")
            return self._marker
        return found

    def encode(self, op: str, schema: str, table: str, topic: str, transaction: bytes, position: int,
               size: bytes, key: bytes | None, before: bytes | None, after: bytes | None,
               backfill: int | None = None) -> bytes:  # fmt: skip
        shape = self.shape(schema, table, key, before, after)
        head = self._head(op, schema, table, topic, shape.prefix)[1]
        return b"".join(_nested(shape, head, transaction, position, size, key, before, after, backfill_tail(backfill)))

    def read_head(self, schema: str, table: str, topic: str, transaction: bytes) -> bytes:
        shape = self.shape(schema, table, None, None, None)
        return self._head("READ", schema, table, topic, shape.prefix)[1] + transaction

    def read_encoder(self, schema: str, table: str, topic: str, transaction: bytes,
                     size: bytes) -> Callable[[int, bytes | None, bytes], bytes]:  # fmt: skip
        head = self.read_head(schema, table, topic, transaction)

        def encode(position: int, key: bytes | None, after: bytes) -> bytes:
            return b"".join((head, long_bytes(position), size, NO_BACKFILL, b"\x00" if key is None else b"\x02",
                             key[5:] if key else b"", b"\x00\x02", after[5:]))  # fmt: skip

        return encode

    def records(self, changes: Iterable[Change], transaction: bytes, size: bytes,
                backfill: int | None = None) -> Iterator[tuple[bytes, bytes]]:  # fmt: skip
        heads, tail = self._heads, backfill_tail(backfill)
        for position, (op, schema, table, topic, key, before, after) in enumerate(changes):
            shape = self.shape(schema, table, key, before, after)
            found = heads.get((op, schema, table, topic, shape.prefix)) or self._head(op, schema, table, topic,
                                                                                     shape.prefix)  # fmt: skip
            found[2][0] += 1
            yield found[0], b"".join(_nested(shape, found[1], transaction, position, size, key, before, after, tail))

    def chunk_parts(self, op: str, schema: str, table: str, topic: str, transaction: bytes, rows: list[Image],
                    backfill: int) -> ChunkParts:  # fmt: skip
        key, after = rows[0] if rows else (None, None)
        shape = self.shape(schema, table, key, None, after)
        kafka_key, head, count = self._head(op, schema, table, topic, shape.prefix)
        count[0] += len(rows)
        return kafka_key, head + transaction, self.size(len(rows)), rows, backfill_tail(backfill), True


def _nested(shape: Shape, head: bytes, transaction: bytes, position: int, size: bytes, key: bytes | None,
            before: bytes | None, after: bytes | None, tail: bytes) -> list[bytes]:  # fmt: skip
    """The parts of one nested change: the fields up to ``backfill`` (``tail``), then each image's union branch and
    its body (the framed image less its frame)."""
    parts = [head, transaction, long_bytes(position), size, tail]
    parts += (b"\x00",) if key is None else (b"\x02", key[5:])
    if before is None:
        parts.append(b"\x00")
    else:
        parts += (KEY_BRANCH if before[:5] == shape.key_frame else ROW_BRANCH, before[5:])
    parts += (b"\x00",) if after is None else (b"\x02", after[5:])
    return parts


def change_writer(fmt: str, key_id: int, value_id: int, images: str = "framed") -> ChangeWriter | JsonChangeWriter:
    if fmt == "json":
        return JsonChangeWriter()
    return NestedChangeWriter(key_id, value_id) if images == "nested" else ChangeWriter(key_id, value_id)
