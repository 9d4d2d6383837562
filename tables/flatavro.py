"""Flat Avro records read and written in C, the rest by fastavro, with the same result.

Promise: for a parsed record schema whose fields are all primitives, enums or unions of one of those
with null, ``reader(parsed)`` gives a ``tables._avro.Reader`` whose ``read(data, start)`` returns exactly
what ``fastavro.schemaless_reader`` returns with that writer schema, and ``writer(parsed)`` a
``tables._avro.Writer`` whose ``write(record)`` returns the bytes ``fastavro.schemaless_writer`` writes
(or None for a record it leaves to fastavro: a value not exactly of its field's type); logical types go
through fastavro's own conversions. For any other schema (nested records, arrays, maps, fixed, named
references, other unions) both give None and the caller uses fastavro. Why: fastavro's generic code cost
~1 us a call and ~0.3 us a field — a 6-column row 5.8 us to read, the compiled reader 1.2-1.7 us — and
the fan-out and the views read every change's envelope and row image (``bench/RESULTS.md``, "Avro in C").
"""

from __future__ import annotations

from typing import Any

from fastavro._logical_readers import LOGICAL_READERS
from fastavro._logical_writers import LOGICAL_WRITERS

from tables._avro import Reader, Writer

KINDS = {"null": 0, "boolean": 1, "int": 2, "long": 3, "float": 4, "double": 5, "bytes": 6, "string": 7}
ENUM = 8
Spec = tuple[str, int, int, Any, Any, Any]  # name, kind, null branch (-1: no union), conv, its schema, symbols


def field_spec(name: str, kind: Any, conversions: dict[str, Any]) -> Spec | None:
    """How ``tables._avro`` handles one field of type ``kind`` (a parsed schema), or None if it cannot."""
    null_branch = -1
    if isinstance(kind, list):
        if len(kind) != 2 or kind.count("null") != 1:
            return None
        null_branch = kind.index("null")
        kind = kind[1 - null_branch]
    if isinstance(kind, str):
        return (name, KINDS[kind], null_branch, None, None, None) if kind in KINDS else None
    if not isinstance(kind, dict):
        return None
    if kind.get("type") == "enum":
        return name, ENUM, null_branch, None, None, tuple(kind["symbols"])
    base = kind.get("type")
    if base not in KINDS:
        return None
    conv = conversions.get(f"{base}-{kind['logicalType']}") if "logicalType" in kind else None
    return name, KINDS[base], null_branch, conv, kind if conv else None, None


def _specs(parsed: Any, conversions: dict[str, Any]) -> tuple[Spec, ...] | None:
    if not isinstance(parsed, dict) or parsed.get("type") != "record":
        return None
    specs = []
    for field in parsed.get("fields", ()):
        spec = field_spec(field["name"], field["type"], conversions)
        if spec is None:
            return None
        specs.append(spec)
    return tuple(specs)


def reader(parsed: Any) -> Reader | None:
    """The compiled reader of a parsed record schema, or None when fastavro must read it."""
    specs = _specs(parsed, LOGICAL_READERS)
    return None if specs is None else Reader(specs)


def writer(parsed: Any) -> Writer | None:
    """The compiled writer of a parsed record schema, or None when fastavro must write it."""
    specs = _specs(parsed, LOGICAL_WRITERS)
    return None if specs is None else Writer(specs)
