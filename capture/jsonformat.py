"""The ``json`` output format (as Bottled Water's ``-f json``): rows and changes as JSON objects.

Promise: pure. ``JsonRowWriter`` writes a row (values from ``tables.types``'
converters) as a JSON object keyed by column name, with exact, readable values:
decimals and money as strings, timestamps as ISO-8601 (``Z`` for timestamptz),
dates and times ISO, bytea as base64, json/jsonb embedded, NaN and infinities as
strings (``infinity``/``-infinity`` dates and timestamps too, where Avro writes
their sentinel: see ``tables.types.Infinite``). ``JsonChangeWriter`` writes
raw-topic changes with the same fields as the Avro ``Change`` record, row images
embedded as objects. No schema registry is used.
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from tables.types import EPOCH_ORDINAL, Infinite, PgType

Change = tuple[str, str, str, str, bytes | None, bytes | None, bytes | None]  # as changes.RowChange

Formatter = Callable[[Any], Any]
EPOCH = datetime(1970, 1, 1)


def _timestamp(micros: int) -> str:
    if isinstance(micros, Infinite):
        return micros.text
    return (EPOCH + timedelta(microseconds=micros)).isoformat()


def _timestamptz(micros: int) -> str:
    text = _timestamp(micros)
    return text if text.endswith("infinity") else text + "Z"


def _date(days: int) -> str:
    if isinstance(days, Infinite):
        return days.text
    return date.fromordinal(days + EPOCH_ORDINAL).isoformat()


def _time(micros: int) -> str:
    seconds, micro = divmod(micros, 1_000_000)
    minutes, second = divmod(seconds, 60)
    hour, minute = divmod(minutes, 60)
    return f"{hour:02d}:{minute:02d}:{second:02d}.{micro:06d}"


def _number(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).replace("inf", "Infinity").replace("nan", "NaN")
    return value


_BY_TYPE: dict[str, Formatter] = {
    "timestamptz": _timestamptz,
    "timestamp": _timestamp,
    "date": _date,
    "time": _time,
    "bytea": lambda v: base64.b64encode(v).decode(),
    "json": json.loads,
    "jsonb": json.loads,
}


def formatter(pgtype: PgType) -> Formatter:
    """How a column's converted value is written in JSON."""
    if pgtype.element is not None:
        item = formatter(pgtype.element)
        return lambda v: [None if x is None else item(x) for x in v]
    if pgtype.typtype == "d" and pgtype.base is not None:
        return formatter(pgtype.base)
    return _BY_TYPE.get(pgtype.name, _number)


class JsonRowWriter:
    """Rows of one table shape as JSON objects (same call shape as ``AvroWriter``)."""

    def __init__(self, names: Sequence[str], types: Sequence[PgType]) -> None:
        self.names = list(names)
        self.formats = [formatter(t) for t in types]

    def encode(self, values: Sequence[Any]) -> bytes:
        row = {n: None if v is None else f(v) for n, f, v in zip(self.names, self.formats, values, strict=True)}
        return json.dumps(row, separators=(",", ":"), ensure_ascii=False).encode()


def _iso_utc(micros: int) -> str:
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)).isoformat().replace("+00:00", "Z")


class JsonChangeWriter:
    """Raw-topic keys and values as JSON (same call shape as ``ChangeWriter``)."""

    key_id = value_id = 0

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], list[int]] = {}  # (schema, table, op) -> [changes since counted]

    def learn(self, table: object, ids: object) -> None:
        """A table shape was registered: nothing to learn (the json format nests every image)."""

    def encode_key(self, schema: str, table: str) -> bytes:
        return json.dumps({"schema": schema, "table": table}, separators=(",", ":")).encode()

    @staticmethod
    def transaction(commit_lsn: int, xid: int, commit_time: int) -> bytes:
        return f'"commit_lsn":{commit_lsn},"xid":{xid},"commit_time":"{_iso_utc(commit_time)}"'.encode()

    def encode(self, op: str, schema: str, table: str, topic: str, transaction: bytes, position: int,
               size: bytes, key: bytes | None, before: bytes | None, after: bytes | None,
               backfill: int | None = None) -> bytes:  # fmt: skip
        head = json.dumps({"op": op, "schema": schema, "table": table, "topic": topic}, separators=(",", ":"))
        parts = [head[:-1].encode(), b",", transaction, b',"position":', str(position).encode(), b',"tx_size":', size]
        for name, image in ((b"key", key), (b"before", before), (b"after", after)):
            parts += [b',"', name, b'":', image if image is not None else b"null"]
        parts += [b',"backfill":', b"null" if backfill is None else str(backfill).encode(), b"}"]
        return b"".join(parts)

    @staticmethod
    def size(count: int) -> bytes:
        return str(count).encode()

    def read_encoder(self, schema: str, table: str, topic: str, transaction: bytes,
                     size: bytes) -> Callable[[int, bytes | None, bytes], bytes]:  # fmt: skip
        """``encode(position, key, after)`` of one table's READ changes."""

        def encode(position: int, key: bytes | None, after: bytes) -> bytes:
            return self.encode("READ", schema, table, topic, transaction, position, size, key, None, after)

        return encode

    def take_counts(self) -> Counter[tuple[str, str, str]]:
        """Changes ``records`` wrote by (schema, table, op) since the last call."""
        out: Counter[tuple[str, str, str]] = Counter()
        for found, cell in self.counts.items():
            if cell[0]:
                out[found] += cell[0]
                cell[0] = 0
        return out

    def chunk(self, op: str, schema: str, table: str, topic: str, transaction: bytes,
              rows: list[tuple[bytes | None, bytes | None]], backfill: int
              ) -> Iterator[tuple[bytes, bytes]]:  # fmt: skip
        """(Kafka key, value) of a backfill chunk's changes (``rows``: key and after images), positions from 0."""
        changes = [(op, schema, table, topic, key, None, after) for key, after in rows]
        return self.records(changes, transaction, self.size(len(rows)), backfill)

    def records(self, changes: Iterable[Change], transaction: bytes, size: bytes,
                backfill: int | None = None) -> Iterator[tuple[bytes, bytes]]:  # fmt: skip
        """(Kafka key, value) of each change of one transaction, positions from 0."""
        counts = self.counts
        for position, (op, schema, table, topic, key, before, after) in enumerate(changes):
            cell = counts.get((schema, table, op)) or counts.setdefault((schema, table, op), [0])
            cell[0] += 1  # a cell per (table, op): no Counter lookup and hash update per change
            value = self.encode(op, schema, table, topic, transaction, position, size, key, before, after, backfill)
            yield self.encode_key(schema, table), value
