"""PostgreSQL's row text straight to Avro bytes, compiled per table shape: capture's hot path.

Promise: ``Transcoder(table, value_prefix, key_prefix)`` holds two functions generated
from the table's columns and registered schemas, each a pure function of its bytes:

- ``row(buf, pos)`` reads one pgoutput TupleData and returns ``(value, key, large, end)``
  — the framed Avro value and key (``None`` for a table without key), the
  ``(column index, text)`` of values long enough to be TOASTed (or ``None``), and the
  offset after the tuple;
- ``key(buf, pos)`` reads a key-only old tuple and returns ``(key, end)``.

They give ``None`` (or raise) for anything off the common path: an unchanged TOAST value,
a binary column, NULL in a non-null column, a numeric that is NaN or not at the column's
scale, a malformed message. The caller then takes the general path (``capture.decoder``,
then ``RowEncoder``), which is the reference: whenever a transcoder answers, its bytes are
exactly what the general path writes (tests check both on the same rows). Fusing decoding, text
conversion and Avro encoding into one straight function per table skips the
intermediate tuples, lists and calls: about half of capture's per-change work. Text
passes through as bytes, which is valid only for a UTF8 server, so capture uses
transcoders only there.

``copier_columns(table)`` describes the same columns to the snapshot's compiled
``capture._copier.Copier`` (which reads ``COPY`` text): each column's kind and the
column's general encoder for the values its kind does not cover.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, NamedTuple

from capture import _copier
from capture.encoder import FIXED_SIZE, TOAST_MIN, AvroWriter, RowEncoder
from tables.avro import _DOUBLE, Encoder, _Compiler, long_bytes
from tables.catalog import TableSchema
from tables.types import parse_bool, parse_date, parse_numeric, parse_timestamp

Row = tuple[bytes, bytes | None, list[tuple[int, str]] | None, int]
RowFn = Callable[[bytes, int], Row | None]
KeyFn = Callable[[bytes, int], tuple[bytes, int] | None]
ColumnSpec = tuple[int, bool, bool, bool, int, tuple[bytes, ...], Callable[[bytes], bytes]]


_STAMPS: dict[bytes, bytes] = {}  # timestamp text -> Avro long: a transaction's rows share now()


def _timestamp(raw: bytes) -> bytes:
    if len(_STAMPS) >= 4096:
        _STAMPS.clear()
    found = _STAMPS[raw] = long_bytes(parse_timestamp(raw.decode("ascii")))
    return found


def _kind(schema: Any) -> tuple[bool, Any]:
    """(nullable, the non-null type) of a field type as ``tables.catalog`` writes them."""
    if isinstance(schema, list) and schema and schema[0] == "null":
        rest = schema[1:]
        return True, rest[0] if len(rest) == 1 else rest
    return False, schema


class _Column:
    """Generated statements for one column, run with its text at t (n bytes).

    They append the column's encoding to the parts list through ``a``; a key column's
    encoding is also kept in ``x<i>`` for the key record (key columns are never null).
    """

    def __init__(self, index: int, field: dict[str, Any], converter: Any, encoder: Encoder, key: bool) -> None:
        self.i = index
        self.nullable, self.avro = _kind(field["type"])
        self.conv = converter
        self.encoder = encoder  # the whole field type (union included): the general case
        self.key = key
        self.toastable = converter not in FIXED_SIZE
        self.kind = self._kind()

    def statements(self) -> list[str]:
        i = self.i
        if self.key and self.conv is int and self.avro in ("int", "long"):  # the common key, kept cheap
            return [f"x{i} = lb(int(t))", f"a(x{i})"]
        lines = self._encode()
        if self.toastable:
            lines += [f"if n >= {TOAST_MIN}:", f"    L = large(L, {i}, t)"]
        if self.key:
            lines = ["m = len(v)", *lines, f"x{i} = b''.join(v[m:])"]
        return lines

    def _kind(self) -> int:
        """How the value is written: one of ``capture._copier``'s kinds (``OTHER``: the field's encoder)."""
        avro, conv = self.avro, self.conv
        if conv is int and avro in ("int", "long"):
            return _copier.LONG
        if conv is str and (avro == "string" or (isinstance(avro, dict) and avro.get("type") == "string")):
            return _copier.STRING
        if conv is parse_numeric and isinstance(avro, list) and isinstance(avro[0], dict):
            return _copier.DECIMAL  # the union (decimal, string) of a numeric(p, s)
        if conv is parse_timestamp:
            return _copier.TIMESTAMP
        if conv is parse_date and avro == {"type": "int", "logicalType": "date"}:
            return _copier.DATE
        if conv is str and isinstance(avro, dict) and avro.get("type") == "enum":
            return _copier.ENUM
        if conv is parse_bool and avro == "boolean":
            return _copier.BOOL
        if conv is float and avro == "double":
            return _copier.DOUBLE
        return _copier.OTHER

    def _encode(self) -> list[str]:
        i, kind = self.i, self.kind
        tag = ["a(b'\\x02')"] if self.nullable else []
        if kind == _copier.LONG:
            return [*tag, "a(lb(int(t)))"]
        if kind == _copier.STRING:
            return [*tag, "a(lb(n))", "a(t)"]
        if kind == _copier.DECIMAL:
            union = "a(b'\\x02')" if self.nullable else "a(b'\\x00')"  # the decimal branch
            return [union, *_decimal_lines(int(self.avro[0].get("scale", 0)))]
        if kind == _copier.TIMESTAMP:
            return [*tag, "a(TS.get(t) or ts(t))"]
        if kind == _copier.ENUM:
            return [*tag, f"a(E{i}[t])"]
        if kind == _copier.BOOL:
            return [*tag, "a(b'\\x01' if t == b't' else b'\\x00')"]
        if kind == _copier.DOUBLE:
            return [*tag, "a(D(float(t)))"]
        # the general case: convert the text, encode with the field's own encoder (union tag included)
        return [f"f{i}(c{i}(t.decode('utf-8')), v)"]

    def spec(self) -> ColumnSpec:
        """The column for ``capture._copier.Copier``."""
        labels = tuple(x.encode() for x in self.avro["symbols"]) if self.kind == _copier.ENUM else ()
        scale = int(self.avro[0].get("scale", 0)) if self.kind == _copier.DECIMAL else 0
        return (self.kind, self.nullable, self.key, self.toastable, scale, labels, self.general)

    def general(self, raw: bytes) -> bytes:
        """The field's encoding (union tag included) by its converter and encoder: the reference."""
        parts: list[bytes] = []
        self.encoder(self.conv(raw.decode("utf-8")), parts)
        return b"".join(parts)

    def null(self) -> list[str]:
        return ["a(b'\\x00')"] if self.nullable else ["return None"]


def _decimal_lines(scale: int) -> list[str]:
    """numeric(p, s) prints exactly s decimals: the digits without the point are the unscaled value."""
    if scale == 0:
        check = ["if b'.' in t:", "    return None", "u = int(t)"]
    else:
        check = [
            "d = t.find(b'.')",
            f"if d < 0 or n - d - 1 != {scale}:",
            "    return None",
            "u = int(t[:d] + t[d + 1:])",
        ]
    return [*check, "w = u.to_bytes((u.bit_length() + 8) // 8, 'big', signed=True)", "a(lb(len(w)))", "a(w)"]


def _large(found: list[tuple[int, str]] | None, index: int, raw: bytes) -> list[tuple[int, str]] | None:
    text = raw.decode("utf-8")
    if len(text) < TOAST_MIN:
        return found
    return [*(found or ()), (index, text)]


_HEAD = [
    "    if buf[p] != {hi} or buf[p + 1] != {lo}:",
    "        return None",
    "    p += 2",
]
_READ = [
    "k = buf[p]",
    "if k == 116:",
    "    n = I(buf, p + 1)[0]",
    "    s = p + 5",
    "    p = s + n",
    "    t = buf[s:p]",
]


def _columns(table: TableSchema) -> list[_Column]:
    fields = table.value_schema["fields"]
    compiler = _Compiler()
    namespace = table.value_schema["namespace"]
    return [
        _Column(i, f, conv, compiler.compile(f["type"], namespace), table.columns[i].is_key)
        for i, (f, conv) in enumerate(zip(fields, table.converters, strict=True))
    ]


def copier_columns(table: TableSchema) -> list[ColumnSpec]:
    """The table's columns as ``capture._copier.Copier`` takes them."""
    return [c.spec() for c in _columns(table)]


def _generate(table: TableSchema, value_prefix: bytes, key_prefix: bytes | None) -> tuple[RowFn, KeyFn | None]:
    columns = _columns(table)
    count = len(columns)
    head = [line.format(hi=count >> 8, lo=count & 0xFF) for line in _HEAD]
    keys = [c.i for c in columns if c.key]
    row = ["def row(buf, p):", *head, "    v = [VP]", "    a = v.append", "    L = None"]
    keyfn = ["def key(buf, p):", *head]
    for c in columns:
        row.extend("    " + line for line in _READ)
        row.extend("        " + line for line in c.statements())
        row.append("    elif k == 110:")
        row.extend(f"        {line}" for line in ["p += 1", *c.null()])
        row.append("    else:")
        row.append("        return None")
        if c.key:
            keyfn.extend("    " + line for line in _READ)
            keyfn.extend("        " + line for line in ["v = []", "a = v.append", "L = None", *c.statements()])
            keyfn.append("    else:")
            keyfn.append("        return None")
        else:  # skip it, whatever it holds ('n' in a key-only tuple)
            keyfn.append("    k = buf[p]")
            keyfn.append("    p += 1 + (4 + I(buf, p + 1)[0] if k == 116 or k == 98 else 0)")
    key_expr = "KP + " + " + ".join(f"x{i}" for i in keys) if keys and key_prefix is not None else "None"
    row.append(f"    return b''.join(v), {key_expr}, L, p")
    keyfn.append(f"    return {key_expr}, p")
    namespace_: dict[str, Any] = {
        "I": struct.Struct("!i").unpack_from,
        "lb": long_bytes,
        "D": _DOUBLE,
        "ts": _timestamp,
        "TS": _STAMPS,
        "large": _large,
        "VP": value_prefix,
        "KP": key_prefix,
    }
    for c in columns:
        namespace_[f"f{c.i}"] = c.encoder
        namespace_[f"c{c.i}"] = c.conv
        if c.kind == _copier.ENUM:
            namespace_[f"E{c.i}"] = {label.encode(): long_bytes(n) for n, label in enumerate(c.avro["symbols"])}
    source = "\n\n".join("\n".join(lines) for lines in (row, keyfn)) + "\n"
    exec(compile(source, f"<transcoder {table.qualified}>", "exec"), namespace_)  # noqa: S102 - from a schema
    return namespace_["row"], (namespace_["key"] if key_expr != "None" else None)


class Transcoder:
    """The generated ``row`` and ``key`` functions of one table shape (see the module's promise)."""

    def __init__(self, table: TableSchema, value_prefix: bytes, key_prefix: bytes | None) -> None:
        self.table = table
        self.row, self.key = _generate(table, value_prefix, key_prefix)


class CopierSpec(NamedTuple):
    """What ``capture._copier.Copier`` needs of one table shape besides the envelope."""

    columns: list[ColumnSpec]
    value_prefix: bytes
    key_prefix: bytes | None


def copier_spec(encoder: RowEncoder) -> CopierSpec | None:
    """The columns and frames of an Avro ``RowEncoder``'s table shape (None for the json format)."""
    if not isinstance(encoder.value, AvroWriter):
        return None
    key = encoder.key.prefix if isinstance(encoder.key, AvroWriter) else None
    return CopierSpec(copier_columns(encoder.table), encoder.value.prefix, key)


def transcoder(encoder: RowEncoder) -> Transcoder | None:
    """The transcoder of an Avro ``RowEncoder``'s table shape (None for the json format)."""
    if not isinstance(encoder.value, AvroWriter):
        return None
    key = encoder.key.prefix if isinstance(encoder.key, AvroWriter) else None
    return Transcoder(encoder.table, encoder.value.prefix, key)
