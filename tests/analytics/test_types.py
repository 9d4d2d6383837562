"""Avro schemas to Spark types, and raw decoded values to Arrow columns (pure)."""

from __future__ import annotations

import io
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import fastavro
import pytest
from pyspark.sql import types as T

from analytics.types import UnsupportedSchema, arrow_type, column_array, record_fields, struct_type
from tables.avro import plain
from tables.types import INTERVAL_SCHEMA, parse_date, parse_timestamp

pytestmark = pytest.mark.unit

DECIMAL = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}
SCHEMA: dict[str, Any] = {
    "type": "record", "name": "row", "namespace": "headwater.public",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "small", "type": ["null", "int"], "default": None},
        {"name": "ratio", "type": ["null", "float"], "default": None},
        {"name": "score", "type": "double"},
        {"name": "ok", "type": ["null", "boolean"], "default": None},
        {"name": "price", "type": DECIMAL},
        {"name": "amount", "type": ["null", DECIMAL, "string"], "default": None},
        {"name": "huge", "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 60, "scale": 3}]},
        {"name": "born", "type": ["null", {"type": "int", "logicalType": "date"}]},
        {"name": "alarm", "type": ["null", {"type": "long", "logicalType": "time-micros"}]},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "local", "type": ["null", {"type": "long", "logicalType": "local-timestamp-micros"}]},
        {"name": "uid", "type": ["null", {"type": "string", "logicalType": "uuid"}]},
        {"name": "blob", "type": ["null", "bytes"]},
        {"name": "mood", "type": {"type": "enum", "name": "mood", "symbols": ["happy", "sad"]}},
        {"name": "other_mood", "type": ["null", "headwater.public.mood"]},
        {"name": "tags", "type": ["null", {"type": "array", "items": ["null", "string"]}]},
        {"name": "prices", "type": {"type": "array", "items": DECIMAL}},
        {"name": "span", "type": ["null", INTERVAL_SCHEMA]},
        {"name": "span2", "type": ["null", "headwater.pg.Interval"]},
        {"name": "attrs", "type": {"type": "map", "values": "long"}},
        {"name": "either", "type": ["null", "long", "string"]},
    ],
}  # fmt: skip


def test_every_avro_type_maps_to_the_spark_type_that_holds_it_exactly() -> None:
    got = {f.name: (f.dataType, f.nullable) for f in struct_type(SCHEMA).fields}
    interval = T.StructType([T.StructField("months", T.IntegerType(), False),
                             T.StructField("days", T.IntegerType(), False),
                             T.StructField("microseconds", T.LongType(), False)])  # fmt: skip
    assert got == {
        "id": (T.LongType(), False), "small": (T.IntegerType(), True), "ratio": (T.FloatType(), True),
        "score": (T.DoubleType(), False), "ok": (T.BooleanType(), True), "price": (T.DecimalType(12, 2), False),
        "amount": (T.DecimalType(12, 2), True), "huge": (T.StringType(), True), "born": (T.DateType(), True),
        "alarm": (T.TimeType(6), True), "at": (T.TimestampType(), False), "local": (T.TimestampNTZType(), True),
        "uid": (T.StringType(), True), "blob": (T.BinaryType(), True), "mood": (T.StringType(), False),
        "other_mood": (T.StringType(), True), "tags": (T.ArrayType(T.StringType(), True), True),
        "prices": (T.ArrayType(T.DecimalType(12, 2), False), False), "span": (interval, True),
        "span2": (interval, True), "attrs": (T.MapType(T.StringType(), T.LongType(), False), False),
        "either": (T.StringType(), True),
    }  # fmt: skip


def raw(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` written with the real schema, read back raw with the plain one (what the reader does)."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(SCHEMA), value)
    out.seek(0)
    result: dict[str, Any] = fastavro.schemaless_reader(out, fastavro.parse_schema(plain(SCHEMA)), None)
    return result


def test_raw_values_become_arrow_values_spark_reads_back_exactly() -> None:
    at = datetime(2026, 11, 21, 10, 30, 1, 123456, tzinfo=UTC)
    row = {
        "id": 7, "small": None, "ratio": 1.5, "score": 2.25, "ok": True, "price": Decimal("1234567890.12"),
        "amount": "NaN", "huge": Decimal("123456789012345678901234567890123456789012345.678"),
        "born": date(1999, 12, 31), "alarm": None, "at": at, "local": datetime(2026, 1, 2, 3, 4, 5),
        "uid": "0e1d4f5a-7c1b-4d8e-9f00-000000000001", "blob": b"\x00\xff", "mood": "sad", "other_mood": None,
        "tags": ["a", None], "prices": [Decimal("-0.01"), Decimal("99.99")],
        "span": {"months": 1, "days": -2, "microseconds": 3}, "span2": None, "attrs": {"k": 1}, "either": 5,
    }  # fmt: skip
    decoded = raw(row)
    columns = {}
    for field in record_fields(SCHEMA):
        array = column_array([decoded[field.name]], field, arrow_type(field.spark))
        columns[field.name] = array.to_pylist()[0]
    assert columns["price"] == Decimal("1234567890.12")
    assert columns["amount"] is None  # NaN has no decimal: the string branch reads as null
    assert columns["huge"] == "123456789012345678901234567890123456789012345.678"
    assert columns["born"] == date(1999, 12, 31)
    assert columns["at"] == at
    assert columns["local"] == datetime(2026, 1, 2, 3, 4, 5)
    assert columns["prices"] == [Decimal("-0.01"), Decimal("99.99")]
    assert columns["span"] == {"months": 1, "days": -2, "microseconds": 3}
    assert columns["tags"] == ["a", None] and columns["mood"] == "sad" and columns["blob"] == b"\x00\xff"
    assert columns["attrs"] == [("k", 1)] and columns["either"] == "5"


@pytest.mark.parametrize("text", ["infinity", "-infinity"])
def test_infinite_dates_and_timestamps_arrive_as_the_ends_spark_holds(text: str) -> None:
    """What capture writes for PostgreSQL's infinities (README "Types") is in Arrow's and Spark's range."""
    ends = {"born": date.max, "at": datetime.max.replace(tzinfo=UTC), "local": datetime.max}
    if text.startswith("-"):
        ends = {"born": date.min, "at": datetime.min.replace(tzinfo=UTC), "local": datetime.min}
    values = {"born": parse_date(text), "at": parse_timestamp(text), "local": parse_timestamp(text)}
    for field in record_fields(SCHEMA):
        if field.name in ends:
            array = column_array([values[field.name]], field, arrow_type(field.spark))
            assert array.to_pylist() == [ends[field.name]], field.name


def test_time_of_day_keeps_microseconds() -> None:
    schema = {"type": "record", "name": "t", "fields": [
        {"name": "alarm", "type": {"type": "long", "logicalType": "time-micros"}}]}  # fmt: skip
    (field,) = record_fields(schema)
    array = column_array([(7 * 3600 + 1) * 1_000_000 + 42], field, arrow_type(field.spark))
    assert str(array.to_pylist()[0]) == "07:00:01.000042"


def test_nested_records_convert_their_decimals_inside_arrays() -> None:
    item = {"type": "record", "name": "item", "fields": [{"name": "unit_price", "type": ["null", DECIMAL]}]}
    schema = {"type": "record", "name": "order",
              "fields": [{"name": "items", "type": {"type": "array", "items": item}}]}  # fmt: skip
    (field,) = record_fields(schema)
    raw_items = [{"unit_price": (12345).to_bytes(3, "big", signed=True)}, {"unit_price": None}]
    array = column_array([raw_items], field, arrow_type(field.spark))
    assert array.to_pylist() == [[{"unit_price": Decimal("123.45")}, {"unit_price": None}]]


def test_a_value_schema_that_is_not_a_record_is_refused() -> None:
    with pytest.raises(UnsupportedSchema, match="must be an Avro record"):
        struct_type({"type": "string"})
    with pytest.raises(UnsupportedSchema, match="before it is defined"):
        struct_type({"type": "record", "name": "r", "fields": [{"name": "a", "type": "nowhere.Thing"}]})
