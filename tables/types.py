"""PostgreSQL types to Avro: schemas for columns and converters from PostgreSQL's text output.

Promise: pure functions. ``avro_type(pgtype, typmod)`` gives the Avro schema of a
column (logical types for decimals, dates, times, timestamps and uuids; every field
carries the PostgreSQL type name in ``pg.type``); ``converter(pgtype, typmod)`` turns
the text PostgreSQL sends (pgoutput and COPY both send it) into the value fastavro
writes for that schema. Values are exact: numeric keeps its precision (NaN and
infinities go to a string branch; unconstrained numeric travels as its exact text),
timestamps keep microseconds, intervals keep months, days and microseconds apart.
PostgreSQL's ``infinity`` and ``-infinity`` dates and timestamps become the
largest and smallest values every standard Avro reader decodes (fastavro, hence
confluent-kafka's AvroDeserializer, Python's ``date``/``datetime``, Spark):
date 9999-12-31 / 0001-01-01, timestamp 9999-12-31T23:59:59.999999 / 0001-01-01T00:00
(UTC for timestamptz) — ``date.max``/``date.min`` and ``datetime.max``/``datetime.min``,
as psycopg2 reads them. They are ``Infinite`` ints, so the json format can still
print ``infinity``; in Avro a real value at the sentinel reads the same.
The session sending the text must use DateStyle=ISO, IntervalStyle=iso_8601,
TimeZone=UTC and lc_monetary=C (``SESSION_OPTIONS``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from typing import Any

SESSION_OPTIONS = "-c DateStyle=ISO -c IntervalStyle=iso_8601 -c TimeZone=UTC -c lc_monetary=C -c extra_float_digits=3"
EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
AVRO_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Converter = Callable[[str], Any]


class UnsupportedValue(ValueError):
    """A value the column's Avro type cannot hold (named with the column by the caller)."""


class Infinite(int):
    """PostgreSQL's ``infinity`` or ``-infinity`` as the sentinel written in Avro (the int's value);
    ``text`` is what PostgreSQL printed."""

    text: str

    def __new__(cls, value: int, text: str) -> Infinite:
        made = super().__new__(cls, value)
        made.text = text
        return made

    def __reduce__(self) -> tuple[type[Infinite], tuple[int, str]]:
        return Infinite, (int(self), self.text)


DAY_MICROS = 86_400_000_000
DATE_INFINITY = Infinite(date.max.toordinal() - EPOCH_ORDINAL, "infinity")  # 9999-12-31: 2,932,896
DATE_MINUS_INFINITY = Infinite(date.min.toordinal() - EPOCH_ORDINAL, "-infinity")  # 0001-01-01: -719,162
TIMESTAMP_INFINITY = Infinite((DATE_INFINITY + 1) * DAY_MICROS - 1, "infinity")  # 9999-12-31T23:59:59.999999
TIMESTAMP_MINUS_INFINITY = Infinite(DATE_MINUS_INFINITY * DAY_MICROS, "-infinity")  # 0001-01-01T00:00:00


@dataclass(frozen=True)
class PgType:
    """What the catalog says about a type (see ``capture.catalog``)."""

    oid: int
    name: str
    namespace: str = "pg_catalog"
    typtype: str = "b"  # b base, e enum, d domain, c composite, r range, m multirange, p pseudo
    element: PgType | None = None  # arrays
    base: PgType | None = None  # domains
    labels: tuple[str, ...] = ()  # enums
    delimiter: str = ","

    @property
    def is_array(self) -> bool:
        return self.element is not None


# ---- text parsers -----------------------------------------------------------------------
def parse_bool(text: str) -> bool:
    return text == "t"


def parse_bytea(text: str) -> bytes:
    if text.startswith("\\x"):
        return bytes.fromhex(text[2:])
    raise UnsupportedValue("bytea must arrive in hex format (bytea_output=hex)")


def parse_date(text: str) -> int:
    """Days since 1970-01-01; ±infinity become 9999-12-31 and 0001-01-01 (``Infinite``)."""
    if text == "infinity":
        return DATE_INFINITY
    if text == "-infinity":
        return DATE_MINUS_INFINITY
    if text.endswith(" BC") or len(text) != 10:
        raise UnsupportedValue(f"dates outside years 1 to 9999 are not supported: {text}")
    return date(int(text[0:4]), int(text[5:7]), int(text[8:10])).toordinal() - EPOCH_ORDINAL


def parse_time(text: str) -> int:
    """Microseconds since midnight (24:00:00 is 86,400,000,000)."""
    hours, minutes, rest = text.split(":")
    seconds, _, frac = rest.partition(".")
    return ((int(hours) * 60 + int(minutes)) * 60 + int(seconds)) * 1_000_000 + int(frac.ljust(6, "0")[:6] or 0)


_DAYS: dict[str, int] = {}


def _days(text: str) -> int:
    """parse_date with a small cache: timestamps of a table share few distinct days."""
    found = _DAYS.get(text)
    if found is None:
        if len(_DAYS) > 100_000:
            _DAYS.clear()
        found = _DAYS[text] = parse_date(text)
    return found


def parse_timestamp(text: str) -> int:
    """Microseconds since 1970-01-01 00:00 (of UTC for timestamptz, sent with TimeZone=UTC);
    ±infinity become 9999-12-31T23:59:59.999999 and 0001-01-01T00:00 (``Infinite``)."""
    size = len(text)
    if size >= 19 and text[10] == " " and text[4] == "-" and text[13] == ":":  # the common, fast case
        body = text[:-3] if text.endswith("+00") else text
        if len(body) == 19 or (body[19] == "." and body[20:].isdigit()):
            seconds = int(body[11:13]) * 3600 + int(body[14:16]) * 60 + int(body[17:19])
            micros = int(body[20:].ljust(6, "0")) if len(body) > 20 else 0
            return (_days(body[:10]) * 86_400 + seconds) * 1_000_000 + micros
    if text == "infinity":
        return TIMESTAMP_INFINITY
    if text == "-infinity":
        return TIMESTAMP_MINUS_INFINITY
    if text.endswith(" BC"):
        raise UnsupportedValue(f"timestamps before year 1 are not supported: {text}")
    day_text, _, time_text = text.partition(" ")
    offset = 0
    zone = re.search(r"[+-]\d\d(:\d\d){0,2}$", time_text)
    if zone:
        sign = -1 if zone.group(0)[0] == "-" else 1
        parts = [int(p) for p in zone.group(0)[1:].split(":")] + [0, 0]
        offset = sign * (parts[0] * 3600 + parts[1] * 60 + parts[2]) * 1_000_000
        time_text = time_text[: zone.start()]
    days = parse_date(day_text)
    return days * DAY_MICROS + parse_time(time_text) - offset


_ISO_INTERVAL = re.compile(
    r"^P(?:(?P<y>-?\d+)Y)?(?:(?P<mo>-?\d+)M)?(?:(?P<w>-?\d+)W)?(?:(?P<d>-?\d+)D)?"
    r"(?:T(?:(?P<h>-?\d+)H)?(?:(?P<mi>-?\d+)M)?(?:(?P<s>-?\d+(?:\.\d+)?)S)?)?$"
)


def parse_interval(text: str) -> dict[str, int]:
    """An ISO 8601 interval (IntervalStyle=iso_8601) as months, days and microseconds."""
    found = _ISO_INTERVAL.match(text)
    if not found:
        raise UnsupportedValue(f"interval not in ISO 8601 form: {text!r} (set IntervalStyle=iso_8601)")
    g = {k: v or "0" for k, v in found.groupdict().items()}
    seconds = Decimal(g["s"])
    micros = (int(g["h"]) * 3600 + int(g["mi"]) * 60) * 1_000_000 + int(seconds * 1_000_000)
    return {"months": int(g["y"]) * 12 + int(g["mo"]), "days": int(g["w"]) * 7 + int(g["d"]), "microseconds": micros}


def parse_numeric(text: str) -> Decimal | str:
    """Finite values as Decimal; NaN and ±Infinity as their text (the union's string branch)."""
    if text in ("NaN", "Infinity", "-Infinity"):
        return text
    return Decimal(text)


def parse_money(text: str) -> Decimal:
    """money under lc_monetary=C: '$1,234.56' or '-$1,234.56'."""
    negative = text.startswith("-") or text.startswith("(")
    digits = re.sub(r"[^0-9.]", "", text)
    value = Decimal(digits)
    return -value if negative else value


def parse_array(text: str, delimiter: str = ",") -> list[Any]:
    """PostgreSQL's array text ('{1,NULL,"a b"}') as nested lists of str or None."""
    if text.startswith("["):  # explicit bounds: '[0:2]={...}'
        text = text[text.index("=") + 1 :]
    value, end = _array_at(text, 0, delimiter)
    if end != len(text):
        raise UnsupportedValue(f"trailing text after array: {text[end:]!r}")
    return value


def _array_at(text: str, pos: int, delim: str) -> tuple[list[Any], int]:
    if text[pos] != "{":
        raise UnsupportedValue(f"expected '{{' at {pos} in {text!r}")
    pos += 1
    items: list[Any] = []
    if text[pos] == "}":
        return items, pos + 1
    while True:
        if text[pos] == "{":
            item, pos = _array_at(text, pos, delim)
            items.append(item)
        elif text[pos] == '"':
            chars = []
            pos += 1
            while text[pos] != '"':
                if text[pos] == "\\":
                    pos += 1
                chars.append(text[pos])
                pos += 1
            items.append("".join(chars))
            pos += 1
        else:
            end = pos
            while text[end] not in (delim, "}"):
                end += 1
            raw = text[pos:end]
            items.append(None if raw == "NULL" else raw)
            pos = end
        if text[pos] == "}":
            return items, pos + 1
        pos += 1  # delimiter


# ---- schemas ------------------------------------------------------------------------------
INTERVAL_SCHEMA = {
    "type": "record",
    "name": "Interval",
    "namespace": "headwater.pg",
    "fields": [
        {"name": "months", "type": "int"},
        {"name": "days", "type": "int"},
        {"name": "microseconds", "type": "long"},
    ],
}

_SIMPLE: dict[str, tuple[Any, Converter]] = {
    "bool": ("boolean", parse_bool),
    "int2": ("int", int),
    "int4": ("int", int),
    "int8": ("long", int),
    "oid": ("long", int),
    "float4": ("float", float),
    "float8": ("double", float),
    "bytea": ("bytes", parse_bytea),
    "date": ({"type": "int", "logicalType": "date"}, parse_date),
    "time": ({"type": "long", "logicalType": "time-micros"}, parse_time),
    "timestamp": ({"type": "long", "logicalType": "local-timestamp-micros"}, parse_timestamp),
    "timestamptz": ({"type": "long", "logicalType": "timestamp-micros"}, parse_timestamp),
    "uuid": ({"type": "string", "logicalType": "uuid"}, str),
    "money": ({"type": "bytes", "logicalType": "decimal", "precision": 19, "scale": 2}, parse_money),
}


def _numeric(typmod: int) -> tuple[Any, Converter]:
    if typmod < 4:  # unconstrained: any scale, so its exact text
        return "string", str
    precision, scale = ((typmod - 4) >> 16) & 0xFFFF, (typmod - 4) & 0xFFFF
    if scale > precision or scale >= 0x8000:  # negative scales (PG15) do not fit Avro decimal
        return "string", str
    decimal = {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}
    return [decimal, "string"], parse_numeric


def _enum(pgtype: PgType) -> tuple[Any, Converter]:
    if pgtype.labels and all(AVRO_NAME.match(label) for label in pgtype.labels):
        name = avro_name(pgtype.name)
        return {
            "type": "enum",
            "name": name,
            "namespace": f"headwater.pg.{avro_name(pgtype.namespace)}",
            "symbols": list(pgtype.labels),
        }, str
    return "string", str


def _array(pgtype: PgType, typmod: int, seen: set[str]) -> tuple[Any, Converter]:
    assert pgtype.element is not None
    item_schema, item_conv = _mapping(pgtype.element, typmod, seen)
    delim = pgtype.element.delimiter

    def convert(text: str) -> list[Any]:
        items = parse_array(text, delim)
        if any(isinstance(item, list) for item in items):
            raise UnsupportedValue("multi-dimensional arrays are not supported; use a one-dimensional array")
        return [None if item is None else item_conv(item) for item in items]

    return {"type": "array", "items": ["null", item_schema]}, convert


def _mapping(pgtype: PgType, typmod: int, seen: set[str]) -> tuple[Any, Converter]:
    """Avro schema and converter; ``seen`` holds named types already defined in this record."""
    if pgtype.is_array:
        return _array(pgtype, typmod, seen)
    if pgtype.typtype == "d" and pgtype.base is not None:
        return _mapping(pgtype.base, typmod, seen)
    if pgtype.typtype == "e":
        schema, conv = _enum(pgtype)
        return _reuse(schema, seen), conv
    if pgtype.name == "numeric":
        return _numeric(typmod)
    if pgtype.name == "interval":
        return _reuse(INTERVAL_SCHEMA, seen), parse_interval
    if pgtype.name in _SIMPLE:
        return _SIMPLE[pgtype.name]
    return "string", str  # text, varchar, char, json(b), inet, cidr, xml, ... and anything else


def _reuse(schema: Any, seen: set[str]) -> Any:
    """A named type is defined once per record; later uses refer to it by full name."""
    if not isinstance(schema, dict) or "name" not in schema:
        return schema
    full = f"{schema['namespace']}.{schema['name']}"
    if full in seen:
        return full
    seen.add(full)
    return schema


def avro_name(name: str) -> str:
    """A valid Avro name for a PostgreSQL identifier (invalid characters become '_')."""
    cleaned = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return cleaned if AVRO_NAME.match(cleaned) else f"_{cleaned}"


def pg_type_label(pgtype: PgType, typmod: int) -> str:
    """The type as PostgreSQL would name it, for the ``pg.type`` attribute."""
    label = pgtype.name if pgtype.namespace == "pg_catalog" else f"{pgtype.namespace}.{pgtype.name}"
    if pgtype.name == "numeric" and typmod >= 4:
        label += f"({((typmod - 4) >> 16) & 0xFFFF},{(typmod - 4) & 0xFFFF})"
    return label


def field(
    name: str, pgtype: PgType, typmod: int, *, nullable: bool, seen: set[str]
) -> tuple[dict[str, Any], Converter]:
    """The Avro field for a column and the converter for its values."""
    schema, conv = _mapping(pgtype, typmod, seen)
    entry: dict[str, Any] = {"name": avro_name(name), "pg.type": pg_type_label(pgtype, typmod)}
    if avro_name(name) != name:
        entry["pg.name"] = name
    if nullable:
        entry["type"] = ["null", *schema] if isinstance(schema, list) else ["null", schema]
        entry["default"] = None
    else:
        entry["type"] = schema
    return entry, conv
