"""Rows to Avro in the Confluent wire format, with the table's registered schema ids.

Promise: ``RowEncoder`` converts a row of PostgreSQL text values with the table's
converters and writes it with fastavro, prefixed by magic byte 0 and the 4-byte
schema id. A value the Avro type cannot hold raises ``UnsupportedValueError`` naming
table and column. ``encode_change`` writes one raw-topic record the same way.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any

import fastavro

from capture._copier import envelopes
from capture.avro import compile_schema, long_bytes
from capture.errors import UnsupportedValueError
from capture.jsonformat import Change, JsonChangeWriter, JsonRowWriter
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

    def __init__(self, key_id: int, value_id: int) -> None:
        self.key_id, self.value_id = key_id, value_id
        self.key = AvroWriter(CHANGE_KEY_SCHEMA, key_id)
        self.prefix = frame(value_id)
        self._ops = {op: long_bytes(i) for i, op in enumerate(OPS)}
        self._keys: dict[tuple[str, str], bytes] = {}
        # (op, schema, table, topic) -> (Kafka key, value head, [changes written by ``records`` since counted])
        self._heads: dict[tuple[str, str, str, str], tuple[bytes, bytes, list[int]]] = {}

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

    def _head(self, op: str, schema: str, table: str, topic: str) -> tuple[bytes, bytes, list[int]]:
        """(Kafka key, the value's bytes up to the transaction, a count) of one op on one table."""
        found = self._heads.get((op, schema, table, topic))
        if found is None:
            head = self.prefix + self._ops[op]
            for text in (schema, table, topic):
                data = text.encode()
                head += long_bytes(len(data)) + data
            found = self._heads[(op, schema, table, topic)] = (self.encode_key(schema, table), head, [0])
        return found

    def take_counts(self) -> Counter[tuple[str, str, str]]:
        """Changes ``records`` wrote by (schema, table, op) since the last call (counted at ~40 ns a change)."""
        out: Counter[tuple[str, str, str]] = Counter()
        for (op, schema, table, _), (_, _, cell) in self._heads.items():
            if cell[0]:
                out[(schema, table, op)] += cell[0]
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
        kafka_key, head, count = self._head(op, schema, table, topic)
        count[0] += len(rows)
        values = envelopes(head + transaction, self.size(len(rows)), rows, backfill_tail(backfill))
        return zip(repeat(kafka_key), values)


def change_writer(fmt: str, key_id: int, value_id: int) -> ChangeWriter | JsonChangeWriter:
    return JsonChangeWriter() if fmt == "json" else ChangeWriter(key_id, value_id)
