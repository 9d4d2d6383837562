"""Decimals written under one scale read under another: a record's raw values made to mean the newest schema's.

Promise: pure. The source decodes every record with its writer's schema stripped of logical types
(``tables.avro.plain``: a decimal is its unscaled integer's bytes) and converts those bytes with the
*newest* value schema's scale (``analytics.types``). After ``ALTER ... TYPE numeric(14,3)`` on a
``numeric(12,2)`` column, or a view that followed it (``streams.follow``), the records written before
hold 1.50 as 150: read with scale 3 that is 0.150. ``rescaler(writer, newest)`` gives the function that
takes a record decoded under ``writer`` to the unscaled integers ``newest`` means — multiplied by a
power of ten for a larger scale, rounded half away from zero (as PostgreSQL's cast to a smaller
scale rounds) for a smaller one — through nested records, lookups' unions and collects' arrays;
None when no decimal's scale differs, so records of the newest schema cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Convert = Callable[[Any], Any]


def rescaler(writer: Any, newest: Any) -> Convert | None:
    """How a raw value of type ``writer`` is made to read as type ``newest`` (None: as it is)."""
    if isinstance(writer, list) or isinstance(newest, list):
        return _union(_branches(writer), _branches(newest))
    if not isinstance(writer, dict) or not isinstance(newest, dict):
        return None  # a primitive, or a named type referred to by name
    if _decimal(writer) and _decimal(newest):
        return _scale(int(writer.get("scale", 0)), int(newest.get("scale", 0)))
    if writer.get("type") == "record" and newest.get("type") == "record":
        return _record(writer, newest)
    if writer.get("type") == "array" and newest.get("type") == "array":
        item = rescaler(writer["items"], newest["items"])
        return None if item is None else (lambda v: None if v is None else [item(x) for x in v])
    return None


def _branches(kind: Any) -> list[Any]:
    return [b for b in (kind if isinstance(kind, list) else [kind]) if b != "null"]


def _union(writer: list[Any], newest: list[Any]) -> Convert | None:
    """A union's values: its decimal branch (bytes) when both have one, else its one branch when each has one."""
    decimals = [b for b in writer if _decimal(b)], [b for b in newest if _decimal(b)]
    if len(decimals[0]) == 1 and len(decimals[1]) == 1:
        scale = rescaler(decimals[0][0], decimals[1][0])
        return None if scale is None else (lambda v: scale(v) if isinstance(v, bytes) else v)
    if len(writer) == 1 and len(newest) == 1:
        one = rescaler(writer[0], newest[0])
        return None if one is None else (lambda v: None if v is None else one(v))
    return None


def _record(writer: dict[str, Any], newest: dict[str, Any]) -> Convert | None:
    kinds = {f["name"]: f["type"] for f in writer["fields"]}
    fields = [(f["name"], c) for f in newest["fields"]
              if f["name"] in kinds and (c := rescaler(kinds[f["name"]], f["type"])) is not None]  # fmt: skip
    if not fields:
        return None

    def convert(record: Any) -> Any:
        if not isinstance(record, dict):
            return record
        out = dict(record)
        for name, conv in fields:
            if name in out:
                out[name] = conv(out[name])
        return out

    return convert


def _decimal(kind: Any) -> bool:
    return isinstance(kind, dict) and kind.get("logicalType") == "decimal" and kind.get("type") == "bytes"


def _scale(was: int, now: int) -> Convert | None:
    """Unscaled big-endian two's complement bytes of scale ``was`` made those of scale ``now``."""
    if was == now:
        return None

    def convert(data: Any) -> Any:
        if not isinstance(data, bytes):
            return data
        n = int.from_bytes(data, "big", signed=True)
        if now > was:
            n *= 10 ** (now - was)
        else:
            q, r = divmod(abs(n), 10 ** (was - now))
            n = (q + (2 * r >= 10 ** (was - now))) * (1 if n >= 0 else -1)
        return n.to_bytes(n.bit_length() // 8 + 1, "big", signed=True)

    return convert
