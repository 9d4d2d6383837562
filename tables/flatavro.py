"""Flat Avro records read and written in C, the rest by fastavro, with the same result.

Promise: for a parsed record schema whose fields are all primitives, enums or unions of those,
``reader(parsed)`` gives a ``tables._avro.Reader`` whose ``read(data, start)`` returns exactly what
``fastavro.schemaless_reader`` returns with that writer schema — nested records and arrays of those
read too (a view's document) — and ``writer(parsed)`` a ``tables._avro.Writer`` whose
``write(record)`` returns the bytes ``fastavro.schemaless_writer`` writes for a flat record (a union's
value in the first branch whose type it has; None for a record it leaves to fastavro: a value not
exactly of its field's type); logical types go through fastavro's own conversions. For any other
schema (maps, fixed, a writer's nested records) both give None and the caller uses fastavro.
Why: fastavro's generic code cost ~1 us a call and ~0.3 us a field — a 6-column row 5.8 us to
read, the compiled reader 1.2-1.7 us — and the fan-out and the views read every change's envelope
and row image, the Redis mirror every view row it writes (``bench/RESULTS.md``, "Avro in C").
``tables.avro``'s compiled encoder is capture's: it takes logical values as the ints and bytes capture
converts them to, while the readers here hold rows as fastavro gives them (datetimes, Decimals).
"""

from __future__ import annotations

from typing import Any

from fastavro._logical_readers import LOGICAL_READERS
from fastavro._logical_writers import LOGICAL_WRITERS

from tables._avro import Reader, Writer

KINDS = {"null": 0, "boolean": 1, "int": 2, "long": 3, "float": 4, "double": 5, "bytes": 6, "string": 7}
ENUM, RECORD, ARRAY = 8, 9, 10
Branch = tuple[int, Any, Any, Any]  # kind, conversion (or None), its schema, enum symbols
Spec = tuple[str, bool, tuple[Branch, ...]]  # name, a union?, its branches (one unless a union)


def branch(kind: Any, conversions: dict[str, Any], named: dict[str, Any], nested: bool) -> Branch | None:
    """How ``tables._avro`` handles a value of type ``kind`` (a parsed schema, not a union), or None; records
    and arrays only when ``nested`` (a reader)."""
    if isinstance(kind, str) and kind not in KINDS:
        kind = named.get(kind)  # a named type defined earlier in the schema
    if isinstance(kind, str):
        return (KINDS[kind], None, None, None) if kind in KINDS else None
    if not isinstance(kind, dict):
        return None
    if kind.get("type") == "enum":
        return ENUM, None, None, tuple(kind["symbols"])
    if kind.get("type") in ("record", "array") and nested:
        return _nested(kind, conversions, named)
    base = kind.get("type")
    if base not in KINDS:
        return None
    conv = conversions.get(f"{base}-{kind['logicalType']}") if "logicalType" in kind else None
    return KINDS[base], conv, kind if conv else None, None


def _null_only(spec: Spec) -> bool:
    """Whether a field is always null: it takes no byte."""
    return spec[2] == ((KINDS["null"], None, None, None),)


def _nested(kind: dict[str, Any], conversions: dict[str, Any], named: dict[str, Any]) -> Branch | None:
    """A record (the Reader of its fields) or an array (the Reader of its item, one field named ''); neither
    when it may take no byte (an array's count could then run past its data)."""
    if kind["type"] == "record":
        fields = _fields(kind, conversions, named, True)
        if fields is None or all(_null_only(f) for f in fields):
            return None
        return RECORD, None, None, Reader(fields)
    item = field_spec("", kind["items"], conversions, named, True)
    if item is None or _null_only(item):
        return None
    return ARRAY, None, None, Reader((item,))


def field_spec(name: str, kind: Any, conversions: dict[str, Any], named: dict[str, Any], nested: bool) -> Spec | None:
    """How ``tables._avro`` handles one field of type ``kind``, or None if it cannot."""
    kinds = kind if isinstance(kind, list) else [kind]
    branches = [branch(k, conversions, named, nested) for k in kinds]
    if not branches or any(b is None for b in branches):
        return None
    return name, isinstance(kind, list), tuple(b for b in branches if b is not None)


def _fields(record: dict[str, Any], conversions: dict[str, Any], named: dict[str, Any],
            nested: bool) -> tuple[Spec, ...] | None:  # fmt: skip
    """How ``tables._avro`` handles each field of a record, or None if it cannot handle one."""
    specs = [field_spec(f["name"], f["type"], conversions, named, nested) for f in record.get("fields", ())]
    return None if any(spec is None for spec in specs) else tuple(spec for spec in specs if spec is not None)


def _specs(parsed: Any, conversions: dict[str, Any], nested: bool) -> tuple[Spec, ...] | None:
    if not isinstance(parsed, dict) or parsed.get("type") != "record":
        return None
    return _fields(parsed, conversions, parsed.get("__named_schemas", {}), nested)  # fastavro's named types


def reader(parsed: Any) -> Reader | None:
    """The compiled reader of a parsed record schema, or None when fastavro must read it."""
    try:
        specs = _specs(parsed, LOGICAL_READERS, nested=True)
    except RecursionError:  # a record that holds itself: fastavro reads it
        return None
    return None if specs is None else Reader(specs)


def writer(parsed: Any) -> Writer | None:
    """The compiled writer of a parsed record schema, or None when fastavro must write it."""
    specs = _specs(parsed, LOGICAL_WRITERS, nested=False)
    return None if specs is None else Writer(specs)
