"""Flat Avro records read and written in C: exactly what fastavro reads and writes, for every column type."""

from __future__ import annotations

import datetime
import io
import math
import random
import uuid
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from tables.change import CHANGE_VALUE_SCHEMA as CHANGE_SCHEMA
from tables.flatavro import reader, writer

pytestmark = pytest.mark.unit
UTC = datetime.UTC
EPOCH_1900 = datetime.datetime(1900, 1, 1, tzinfo=UTC)

TYPES: dict[str, tuple[Any, Any]] = {  # a field type and a maker of random values of it
    "boolean": ("boolean", lambda r: r.random() < 0.5),
    "int": ("int", lambda r: r.choice([0, -1, 1, 2**31 - 1, -(2**31), r.randint(-(2**31), 2**31 - 1)])),
    "long": ("long", lambda r: r.choice([0, -1, 2**63 - 1, -(2**63), r.randint(-(2**63), 2**63 - 1)])),
    "float": ("float", lambda r: r.choice([0.0, -1.5, math.inf, -math.inf, math.nan, r.uniform(-1e30, 1e30)])),
    "double": ("double", lambda r: r.choice([0.0, -0.0, math.inf, math.nan, 5e-324, r.uniform(-1e300, 1e300)])),
    "string": ("string", lambda r: r.choice(["", "a", "héllo wörld ✓ 𝄞", "x" * r.randint(0, 300)])),
    "bytes": ("bytes", lambda r: r.randbytes(r.randint(0, 200))),
    "enum": ({"type": "enum", "name": "mood", "symbols": ["sad", "ok", "happy"]}, lambda r: r.choice(["sad", "happy"])),
    "date": ({"type": "int", "logicalType": "date"},
             lambda r: datetime.date(1, 1, 1) + datetime.timedelta(days=r.randint(0, 3_000_000))),
    "time": ({"type": "long", "logicalType": "time-micros"},
             lambda r: datetime.time(r.randint(0, 23), r.randint(0, 59), r.randint(0, 59), r.randint(0, 999999))),
    "timestamp": ({"type": "long", "logicalType": "local-timestamp-micros"},
                  lambda r: datetime.datetime(1900, 1, 1) + datetime.timedelta(microseconds=r.randint(0, 2**52))),
    "timestamptz": ({"type": "long", "logicalType": "timestamp-micros"},
                    lambda r: EPOCH_1900 + datetime.timedelta(microseconds=r.getrandbits(52))),
    "uuid": ({"type": "string", "logicalType": "uuid"}, lambda r: uuid.UUID(int=r.getrandbits(128))),
    "numeric": ({"type": "bytes", "logicalType": "decimal", "precision": 30, "scale": 4},
                lambda r: Decimal(r.randint(-(10**30) + 1, 10**30 - 1)).scaleb(-4)),
    "money": ({"type": "bytes", "logicalType": "decimal", "precision": 19, "scale": 2},
              lambda r: Decimal(r.randint(-(10**17), 10**17)).scaleb(-2)),
}  # fmt: skip


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def fastavro_reads(parsed: Any, data: bytes) -> Any:
    return fastavro.schemaless_reader(io.BytesIO(data), parsed, None)


def written(parsed: Any, record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parsed, record)
    return out.getvalue()


def every_type() -> Any:
    """A record schema with a field of each type in ``TYPES``, plain and nullable (null first and last)."""
    fields = []
    for name, (kind, _) in TYPES.items():
        named = [{**kind, "name": n} if name == "enum" else kind for n in (name, f"{name}_n", f"{name}_m")]
        fields += [{"name": name, "type": named[0]}, {"name": f"{name}_n", "type": ["null", named[1]]},
                   {"name": f"{name}_m", "type": [named[2], "null"]}]  # fmt: skip (a named type: one name each)
    return fastavro.parse_schema({"type": "record", "name": "row", "fields": fields})


def random_record(rng: random.Random) -> dict[str, Any]:
    record = {}
    for name, (_, make) in TYPES.items():
        record[name] = make(rng)
        record[f"{name}_n"] = make(rng) if rng.random() < 0.6 else None
        record[f"{name}_m"] = make(rng) if rng.random() < 0.6 else None
    return record


def test_every_column_type_plain_and_nullable_either_way_reads_as_fastavro_reads_it() -> None:
    rng, parsed = random.Random(7), every_type()
    compiled = reader(parsed)
    assert compiled is not None
    for _ in range(300):
        data = written(parsed, random_record(rng))
        expected, got = fastavro_reads(parsed, data), compiled.read(b"\0\0\0\0\x07" + data, 5)
        assert list(got) == list(expected)
        assert all(same(expected[k], got[k]) for k in expected), {k: (expected[k], got[k]) for k in expected
                                                                  if not same(expected[k], got[k])}  # fmt: skip


def test_the_raw_change_record_reads_as_fastavro_reads_it() -> None:
    parsed = fastavro.parse_schema(CHANGE_SCHEMA)
    compiled = reader(parsed)
    assert compiled is not None
    record = {field["name"]: None for field in CHANGE_SCHEMA["fields"]}
    record.update(op="UPDATE", schema="public", table="orders", topic="p.orders", commit_lsn=2**40, position=3,
                  tx_size=9, xid=77, commit_time=datetime.datetime(2026, 11, 25, 23, 0, tzinfo=UTC),
                  key=b"\0\0\0\0\x01\x02", after=b"\0\0\0\0\x02abc", backfill=None)  # fmt: skip
    data = written(parsed, {k: v for k, v in record.items() if k in {f["name"] for f in CHANGE_SCHEMA["fields"]}})
    assert compiled.read(data) == fastavro_reads(parsed, data)


@pytest.mark.parametrize("kind", [
    {"type": "map", "values": "long"}, ["null", {"type": "map", "values": "int"}],
    {"type": "fixed", "name": "f", "size": 4}, {"type": "array", "items": "null"},
    {"type": "array", "items": {"type": "record", "name": "inner", "fields": []}},
])  # fmt: skip
def test_other_field_types_are_left_to_fastavro(kind: Any) -> None:
    parsed = fastavro.parse_schema({"type": "record", "name": "r", "fields": [{"name": "x", "type": kind}]})
    assert reader(parsed) is None and writer(parsed) is None


def test_nested_records_and_arrays_read_as_fastavro_reads_them_and_are_left_to_fastavro_to_write() -> None:
    """A view's document: the base row, a lookup (a nullable record), a collect (an array of records, each
    with a lookup of its own)."""
    product = {"type": "record", "name": "product", "fields": [
        {"name": "id", "type": "long"}, {"name": "price", "type": ["null", TYPES["numeric"][0]]}]}  # fmt: skip
    parsed = fastavro.parse_schema({"type": "record", "name": "doc", "fields": [
        {"name": "id", "type": "long"}, {"name": "when", "type": TYPES["timestamptz"][0]},
        {"name": "customer", "type": ["null", {"type": "record", "name": "customer", "fields": [
            {"name": "id", "type": "long"}, {"name": "name", "type": ["null", "string"]}]}]},
        {"name": "items", "type": {"type": "array", "items": {"type": "record", "name": "item", "fields": [
            {"name": "line", "type": "int"}, {"name": "product", "type": ["null", product]}]}}},
        {"name": "tags", "type": {"type": "array", "items": ["null", "string"]}},
        {"name": "also", "type": ["null", "product"]},
    ]})  # fmt: skip
    compiled, rng = reader(parsed), random.Random(5)
    assert compiled is not None and writer(parsed) is None
    for n in range(200):
        doc = {"id": n, "when": EPOCH_1900 + datetime.timedelta(microseconds=rng.getrandbits(52)),
               "customer": rng.choice([None, {"id": n, "name": rng.choice([None, "ann"])}]),
               "items": [{"line": i, "product": rng.choice([None, {"id": i, "price": TYPES["numeric"][1](rng)}])}
                         for i in range(rng.randint(0, 5))],
               "tags": [rng.choice([None, "a", ""]) for _ in range(rng.randint(0, 3))],
               "also": rng.choice([None, {"id": 1, "price": None}])}  # fmt: skip
        data = written(parsed, doc)
        assert compiled.read(data) == fastavro_reads(parsed, data) == doc
    # id 0, when 0, no customer; items: a block of -1 item (count -1, then its size, 2 bytes), then the end; no
    # tags; no also
    blocked = b"\x00\x00\x00" + b"\x01\x04\x02\x00" + b"\x00" + b"\x00" + b"\x00"
    assert compiled.read(blocked) == fastavro_reads(parsed, blocked), "a block that gives its size in bytes"


def test_data_that_ends_early_or_holds_a_wrong_branch_is_refused_not_read_past() -> None:
    parsed = fastavro.parse_schema({"type": "record", "name": "r", "fields": [
        {"name": "a", "type": ["null", "string"]}, {"name": "b", "type": "long"}]})  # fmt: skip
    compiled = reader(parsed)
    assert compiled is not None
    data = written(parsed, {"a": "hello", "b": 2**40})
    assert compiled.read(data) == {"a": "hello", "b": 2**40}
    for cut in range(len(data)):
        with pytest.raises(ValueError, match="ends before"):
            compiled.read(data[:cut])
    with pytest.raises(ValueError, match="branch 2"):
        compiled.read(b"\x04" + data[1:])
    with pytest.raises(ValueError, match="outside"):
        compiled.read(data, len(data) + 1)
    with pytest.raises(UnicodeDecodeError):
        compiled.read(b"\x02\x02\xff\x00")


def test_every_column_type_writes_the_bytes_fastavro_writes() -> None:
    rng, parsed = random.Random(11), every_type()
    compiled = writer(parsed)
    assert compiled is not None
    for _ in range(300):
        record = random_record(rng)
        assert compiled.write(record) == written(parsed, record)


@pytest.mark.parametrize("odd", [
    {"a": 1.5}, {"a": "1"}, {"a": 2**63}, {"b": b"x"}, {"b": "\ud800"}, {"c": 1}, {"d": "angry"}, {"e": "tomorrow"},
    {"f": 1e39}, {"a": True},
])  # fmt: skip
def test_a_value_not_of_its_fields_type_is_left_to_fastavro(odd: dict[str, Any]) -> None:
    parsed = fastavro.parse_schema({"type": "record", "name": "r", "fields": [
        {"name": "a", "type": "long"}, {"name": "b", "type": ["null", "string"]}, {"name": "c", "type": "double"},
        {"name": "d", "type": {"type": "enum", "name": "mood", "symbols": ["sad", "ok"]}},
        {"name": "e", "type": ["null", {"type": "int", "logicalType": "date"}]}, {"name": "f", "type": "float"},
    ]})  # fmt: skip
    compiled = writer(parsed)
    assert compiled is not None
    good = {"a": 1, "b": "x", "c": 1.0, "d": "ok", "e": datetime.date(2026, 11, 25), "f": 0.5}
    assert compiled.write(good) == written(parsed, good)
    assert compiled.write({**good, **odd}) is None
    assert compiled.write({k: v for k, v in good.items() if k != "c"}) is None, "a missing field"


def test_unions_of_several_types_read_and_write_as_fastavro_does() -> None:
    """A numeric column is [decimal, string] (NaN and infinities as text), nullable it is three branches."""
    decimal = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}
    parsed = fastavro.parse_schema({"type": "record", "name": "r", "fields": [
        {"name": "price", "type": [decimal, "string"]}, {"name": "total", "type": ["null", decimal, "string"]},
        {"name": "any", "type": ["null", "long", "double", "string", "boolean"]},
    ]})  # fmt: skip
    read, write = reader(parsed), writer(parsed)
    assert read is not None and write is not None
    for record in [
        {"price": Decimal("12.50"), "total": None, "any": 5},
        {"price": "NaN", "total": "Infinity", "any": 2.5},
        {"price": Decimal("-0.01"), "total": Decimal("99999.99"), "any": "x"},
        {"price": "-Infinity", "total": Decimal("0.00"), "any": True},
        {"price": Decimal("1.00"), "total": None, "any": None},
    ]:
        data = written(parsed, record)
        assert write.write(record) == data, record
        assert read.read(data) == fastavro_reads(parsed, data)
    assert write.write({"price": 1.5, "total": None, "any": None}) is None, "a float fits no branch here"
    flipped = writer(fastavro.parse_schema({"type": "record", "name": "f", "fields": [
        {"name": "x", "type": ["double", "long"]}]}))  # fmt: skip
    assert flipped is not None and flipped.write({"x": 5}) is None, "fastavro writes an int as the double listed first"


def test_an_enum_named_again_by_reference_reads_and_writes_as_fastavro_does() -> None:
    """Two columns of one PostgreSQL enum: the schema defines it once and names it the second time."""
    mood = {"type": "enum", "name": "mood", "namespace": "headwater.pg.public", "symbols": ["sad", "ok", "happy"]}
    parsed = fastavro.parse_schema({"type": "record", "name": "r", "fields": [
        {"name": "now", "type": mood}, {"name": "before", "type": ["null", "headwater.pg.public.mood"]},
    ]})  # fmt: skip
    read, write = reader(parsed), writer(parsed)
    assert read is not None and write is not None
    for record in [{"now": "ok", "before": None}, {"now": "sad", "before": "happy"}]:
        data = written(parsed, record)
        assert write.write(record) == data and read.read(data) == fastavro_reads(parsed, data) == record
