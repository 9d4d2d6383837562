"""The compiled Avro encoder writes exactly what fastavro reads back (and what fastavro writes)."""

from __future__ import annotations

import io
import json
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from capture.encoder import ChangeWriter
from tables.avro import compile_schema, long_bytes
from tables.change import CHANGE_VALUE_SCHEMA
from tables.types import INTERVAL_SCHEMA
from tables.wire import frame

pytestmark = pytest.mark.unit

DECIMAL = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}
ROW = {
    "type": "record",
    "name": "Row",
    "namespace": "t",
    "fields": [
        {"name": "id", "type": "long"},
        {
            "name": "price",
            "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}, "string"],
        },
        {"name": "flag", "type": ["null", "boolean"]},
        {"name": "ratio", "type": "double"},
        {"name": "small", "type": "float"},
        {"name": "name", "type": ["null", "string"]},
        {"name": "mood", "type": {"type": "enum", "name": "Mood", "symbols": ["ok", "meh"]}},
        {"name": "again", "type": ["null", "t.Mood"]},
        {"name": "tags", "type": {"type": "array", "items": ["null", "int"]}},
        {"name": "attrs", "type": {"type": "map", "values": "long"}},
        {"name": "span", "type": ["null", INTERVAL_SCHEMA]},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "blob", "type": "bytes"},
    ],
}


def fastavro_read(schema: Any, data: bytes) -> Any:
    return fastavro.schemaless_reader(io.BytesIO(data), fastavro.parse_schema(json.loads(json.dumps(schema))), None,
                                      return_record_name=False)  # fmt: skip


def fastavro_write(schema: Any, record: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(json.loads(json.dumps(schema))), record)
    return out.getvalue()


@pytest.mark.parametrize(
    "values",
    [
        [
            1,
            Decimal("12.34"),
            True,
            0.5,
            1.5,
            "héllo",
            "ok",
            "meh",
            [1, None, -3],
            {"a": -1},
            {"months": -1, "days": 2, "microseconds": 3},
            0,
            b"\x00\xff",
        ],
        [-(2**63), "NaN", None, -1e300, -0.25, None, "meh", None, [], {}, None, 10**15, b""],
        [2**40, Decimal("-0.01"), False, 3.0, 2.0, "", "ok", "ok", [2**31 - 1], {"": 0}, None, -1, b"x" * 300],
        [0, Decimal("99999999.99"), None, 0.0, 0.0, "x" * 200, "ok", None, [None], {"k": 2**62}, None, 7, b"\x80"],
    ],
)
def test_round_trips_and_matches_fastavro_bytes(values: list[Any]) -> None:
    encode = compile_schema(ROW)
    data = encode(values)
    record = dict(zip([f["name"] for f in ROW["fields"]], values, strict=True))
    assert data == fastavro_write(ROW, record)
    back = fastavro_read(ROW, data)
    for name, value in record.items():
        if name == "ts":
            continue  # fastavro turns it into a datetime
        assert back[name] == value, name


@pytest.mark.parametrize("backfill", [None, 0, 7, 2**40])
def test_change_envelope_matches_fastavro(backfill: int | None) -> None:
    record = {
        "op": "UPDATE", "schema": "public", "table": "orders", "topic": "p.orders", "commit_lsn": 2**40 + 7,
        "xid": 4_000_000_000, "commit_time": 1_700_000_000_123_456, "position": 3, "tx_size": 9,
        "key": b"\x00\x00\x00\x00\x05\x02", "before": None, "after": b"row", "backfill": backfill,
    }  # fmt: skip
    encode = compile_schema(CHANGE_VALUE_SCHEMA)
    expected = fastavro_write(CHANGE_VALUE_SCHEMA, record)
    assert encode([record[f["name"]] for f in CHANGE_VALUE_SCHEMA["fields"]]) == expected
    writer = ChangeWriter(1, 2)
    tx = writer.transaction(record["commit_lsn"], record["xid"], record["commit_time"])
    args = (record["op"], "public", "orders", "p.orders", tx, 3, writer.size(9), record["key"], None, b"row")
    assert writer.encode(*args, backfill=backfill) == frame(2) + expected  # type: ignore[arg-type]
    change = ("UPDATE", "public", "orders", "p.orders", record["key"], None, b"row")
    records = list(writer.records([change] * 4, tx, writer.size(9), backfill))
    assert records[3] == (writer.encode_key("public", "orders"), frame(2) + expected)


@pytest.mark.parametrize("op", ["READ", "DELETE"])
def test_a_backfill_chunk_is_written_as_records_writes_it(op: str) -> None:
    """The compiled ``envelopes`` (a backfill's chunk) and ``records`` write the same bytes."""
    writer = ChangeWriter(1, 2)
    tx = writer.transaction(2**33, 0, 1_700_000_000_000_000)
    rows = [(b"\0\0\0\0\x05k%d" % i, None if op == "DELETE" else b"\0\0\0\0\x06" + b"v" * i) for i in range(130)]
    rows.append((None, None if op == "DELETE" else b"unkeyed"))
    changes = [(op, "s", "t", "p.s.t", key, None, after) for key, after in rows]
    assert list(writer.chunk(op, "s", "t", "p.s.t", tx, rows, 77)) == list(
        writer.records(changes, tx, writer.size(len(rows)), 77))


def test_records_without_the_backfill_field_read_as_null_with_the_new_schema() -> None:
    """Records the raw topic held before ``backfill`` was added still read (Avro resolution, its default)."""
    old = {**CHANGE_VALUE_SCHEMA, "fields": [f for f in CHANGE_VALUE_SCHEMA["fields"] if f["name"] != "backfill"]}
    record = {"op": "READ", "schema": "s", "table": "t", "topic": "p.s.t", "commit_lsn": 1, "xid": 0,
              "commit_time": 0, "position": 0, "tx_size": 0, "key": None, "before": None, "after": b"x"}  # fmt: skip
    data = fastavro_write(old, record)
    back: Any = fastavro.schemaless_reader(io.BytesIO(data), fastavro.parse_schema(old),
                                           fastavro.parse_schema(CHANGE_VALUE_SCHEMA))  # fmt: skip
    assert back["backfill"] is None and back["after"] == b"x"
    read = ChangeWriter(1, 2).read_encoder("s", "t", "p.s.t", ChangeWriter.transaction(1, 0, 0), b"\x00")
    assert read(0, None, b"x") == frame(2) + fastavro_write(CHANGE_VALUE_SCHEMA, {**record, "backfill": None})


def test_varints() -> None:
    assert [long_bytes(n) for n in (0, -1, 1, -64, 64)] == [b"\x00", b"\x01", b"\x02", b"\x7f", b"\x80\x01"]
