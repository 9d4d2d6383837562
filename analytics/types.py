"""Avro schemas to Spark types, and decoded Avro values to Arrow columns.

Promise: pure functions. ``struct_type(schema)`` gives the Spark ``StructType`` of an
Avro record: decimal(p,s) for decimals up to 38 digits (wider ones as their exact text),
date, time, timestamp (``timestamp-*``) and timestamp_ntz (``local-timestamp-*``),
binary, strings for enums, uuids and everything textual, arrays, structs for nested
records, maps with string keys; a field is nullable when its union holds ``null``.
Records are decoded with ``tables.avro.plain(schema)`` (no logical types) so values arrive
as their raw ints and bytes, and ``Column.array(values)`` turns a list of them into an Arrow
array of the type Spark expects (``arrow_type`` of the Spark type) without building a Python
date, datetime or Decimal per value where it can.
A union of a decimal and a string (how capture writes numerics that may be NaN or
infinite) maps to the decimal; its string values (NaN, Infinity) read as null.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Context, Decimal
from typing import Any

import pyarrow as pa
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema, to_arrow_type

Convert = Callable[[Any], Any]
MAX_PRECISION = 38  # Spark's widest decimal
EXACT = Context(prec=1001)  # PostgreSQL numerics have at most 1000 digits: scaling never rounds
PRIMITIVES: dict[str, T.DataType] = {
    "boolean": T.BooleanType(), "int": T.IntegerType(), "long": T.LongType(), "float": T.FloatType(),
    "double": T.DoubleType(), "bytes": T.BinaryType(), "string": T.StringType(),
}  # fmt: skip
TIMES = {"time-micros": 1000, "time-millis": 1_000_000}  # to nanoseconds (Spark's TIME is time64[ns])
STAMPS = {"timestamp-micros": 1, "timestamp-millis": 1000, "local-timestamp-micros": 1, "local-timestamp-millis": 1000}


class UnsupportedSchema(ValueError):
    """An Avro schema this mapping cannot give a Spark type (the caller names topic and field)."""


@dataclass(frozen=True)
class Field:
    """A column: its Spark type and how a raw decoded value becomes what Arrow takes."""

    name: str
    spark: T.DataType
    nullable: bool
    convert: Convert | None = field(default=None, compare=False)  # None: the raw value as is


class Names:
    """Named Avro types seen so far while walking a schema (later uses refer to them by name)."""

    def __init__(self) -> None:
        self.types: dict[str, Any] = {}

    def define(self, schema: Mapping[str, Any], namespace: str) -> str:
        name = str(schema["name"])
        space = schema.get("namespace", namespace)
        full = name if "." in name or not space else f"{space}.{name}"
        self.types[full] = schema
        return space if "." not in name else name.rpartition(".")[0]

    def lookup(self, name: str, namespace: str) -> Any:
        for candidate in (name, f"{namespace}.{name}"):
            if candidate in self.types:
                return self.types[candidate]
        raise UnsupportedSchema(f"named type {name!r} is used before it is defined")


def struct_type(schema: Any) -> T.StructType:
    """The Spark type of an Avro record schema (JSON text or parsed JSON)."""
    return T.StructType([T.StructField(f.name, f.spark, f.nullable) for f in record_fields(schema)])


def record_fields(schema: Any) -> list[Field]:
    """The top-level columns of an Avro record schema with their converters."""
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    if not isinstance(parsed, dict) or parsed.get("type") != "record":
        raise UnsupportedSchema("a topic's value schema must be an Avro record")
    return _fields(parsed, Names(), "")


def _map(schema: Any, names: Names, namespace: str) -> tuple[Any, Convert | None]:
    """(Spark type, converter) of any Avro schema; nullability is the caller's business."""
    if isinstance(schema, str):
        if schema in PRIMITIVES:
            return PRIMITIVES[schema], None
        return _map(names.lookup(schema, namespace), names, namespace)
    if isinstance(schema, list):
        return _union(schema, names, namespace)
    kind = schema.get("type")
    logical = schema.get("logicalType")
    if logical is not None and (mapped := _logical(schema, logical)) is not None:
        return mapped
    if kind == "record":
        return _record(schema, names, namespace)
    if kind == "enum":
        names.define(schema, namespace)
        return T.StringType(), None
    if kind == "fixed":
        names.define(schema, namespace)
        return T.BinaryType(), None
    if kind == "array":
        item, conv = _map(schema["items"], names, namespace)
        return T.ArrayType(item, _nullable(schema["items"])), None if conv is None else _each(conv)
    if kind == "map":
        value, conv = _map(schema["values"], names, namespace)
        return T.MapType(T.StringType(), value, _nullable(schema["values"])), None if conv is None else _values(conv)
    return _map(kind, names, namespace)  # {"type": "long"} and the like


def _logical(schema: Mapping[str, Any], logical: str) -> tuple[Any, Convert | None] | None:
    """The mapping of a logical type, or None to fall back to the underlying type."""
    if logical == "decimal":
        precision, scale = int(schema["precision"]), int(schema.get("scale", 0))
        if precision > MAX_PRECISION:
            return T.StringType(), _decimal_text(scale)
        return T.DecimalType(precision, scale), _decimal(scale)
    if logical == "date":
        return T.DateType(), None
    if logical in TIMES:
        return T.TimeType(6), _times(TIMES[logical])
    if logical in STAMPS:
        spark = T.TimestampType() if logical.startswith("timestamp") else T.TimestampNTZType()
        return spark, None if STAMPS[logical] == 1 else _times(STAMPS[logical])
    return None  # uuid and unknown logical types: the underlying type


def _fields(schema: Mapping[str, Any], names: Names, namespace: str) -> list[Field]:
    inner = names.define(schema, namespace)
    fields = []
    for entry in schema["fields"]:
        spark, conv = _map(entry["type"], names, inner)
        fields.append(Field(str(entry["name"]), spark, _nullable(entry["type"]), conv))
    return fields


def _record(schema: Mapping[str, Any], names: Names, namespace: str) -> tuple[Any, Convert | None]:
    fields = _fields(schema, names, namespace)
    struct = T.StructType([T.StructField(f.name, f.spark, f.nullable) for f in fields])
    converters = [(f.name, f.convert) for f in fields if f.convert is not None]
    if not converters:
        return struct, None

    def convert(record: Any) -> Any:
        if record is None:
            return None
        out = dict(record)
        for name, conv in converters:
            out[name] = conv(out[name])
        return out

    return struct, convert


def _union(branches: list[Any], names: Names, namespace: str) -> tuple[Any, Convert | None]:
    present = [b for b in branches if b != "null"]
    if len(present) == 1:
        return _map(present[0], names, namespace)
    if len(present) == 2 and present[1] == "string" and _is_decimal(present[0]):
        spark, conv = _map(present[0], names, namespace)  # NaN / Infinity ride in the string branch
        assert conv is not None
        return spark, lambda v: None if isinstance(v, str) else conv(v)
    for branch in present:
        _map(branch, names, namespace)  # define the named types the branches carry
    return T.StringType(), _json_text


def _is_decimal(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("logicalType") == "decimal"


def _nullable(schema: Any) -> bool:
    return isinstance(schema, list) and "null" in schema


def _decimal(scale: int) -> Convert:
    def convert(raw: Any) -> Decimal | None:
        if raw is None:
            return None
        return Decimal(int.from_bytes(raw, "big", signed=True)).scaleb(-scale, EXACT)

    return convert


def _decimal_text(scale: int) -> Convert:
    exact = _decimal(scale)
    return lambda raw: None if raw is None else str(exact(raw))


def _times(factor: int) -> Convert:
    return lambda raw: None if raw is None else raw * factor


def _each(conv: Convert) -> Convert:
    return lambda items: None if items is None else [conv(i) for i in items]


def _values(conv: Convert) -> Convert:
    return lambda entries: None if entries is None else {k: conv(v) for k, v in entries.items()}


def _json_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.hex()
    return value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)


def arrow_type(spark: T.DataType) -> pa.DataType:
    """The Arrow type Spark reads a column of ``spark`` type from (timestamps in UTC)."""
    return to_arrow_type(spark, timezone="UTC")


def arrow_schema(spark: T.StructType) -> pa.Schema:
    """The Arrow schema of a batch Spark takes for rows of ``spark`` (nullability included)."""
    return to_arrow_schema(spark, timezone="UTC")


def column_array(values: list[Any], column: Field, kind: pa.DataType) -> pa.Array:
    """An Arrow array of ``kind`` from raw decoded values of ``column``."""
    if column.convert is not None:
        values = [column.convert(v) for v in values]
    return pa.array(values, type=kind)
