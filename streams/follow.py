"""A view's schema made to hold what its tables' columns hold after an ``ALTER ... TYPE``.

Promise: pure. A view's schema is composed at start from its tables' value schemas
(``streams.joins.view_schema``). When capture registers a wider type for a column a view shows —
``numeric(12,2)`` made ``numeric(14,3)``, ``int`` made ``bigint``, ``real`` made ``double
precision`` — the rows the worker applies carry values the composed schema cannot write (fastavro
refuses a Decimal of a larger scale). ``follow(view, table, columns)`` gives the view's schema with
each of ``table``'s columns widened to hold the values of both types (a decimal: the larger scale
and the larger count of whole digits; ``int``→``long`` or ``double``; ``float``→``double``; arrays item
by item — only widenings that hold every value exactly), or the same object
when none needs it. Only types change: the view keeps its columns (a column added still reaches
it after a restart), and types it cannot widen (an enum's new symbol, a timestamp's new unit) are
left as they are. Widening, never narrowing, means the rows the state already holds, written
under the old type, are written exactly under the new one, and a replay of older changes widens
nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tables.wire import SCHEMA_BASE

PROMOTIONS = {("int", "long"): "long", ("float", "double"): "double", ("int", "double"): "double"}  # exact ones


def follow(view: dict[str, Any], table: str, columns: Mapping[str, Any]) -> dict[str, Any]:
    """``view`` with ``table``'s columns widened to also hold the types of ``columns`` (a value schema's fields by
    name; their ``pg.type`` comes along); ``view`` itself when nothing needs widening."""
    return _record(view, view[SCHEMA_BASE], table, columns)


def _record(record: dict[str, Any], own: str, table: str, columns: Mapping[str, Any]) -> dict[str, Any]:
    """A record of the view (the rows of table ``own``) with its fields and joined records followed."""
    fields = [_field(f, own, table, columns) for f in record["fields"]]
    if all(new is old for new, old in zip(fields, record["fields"], strict=True)):
        return record
    return {**record, "fields": fields}


def _field(entry: dict[str, Any], own: str, table: str, columns: Mapping[str, Any]) -> dict[str, Any]:
    if "pg.join" in entry:
        kind = entry["type"]
        many = isinstance(kind, dict)
        sub = kind["items"] if many else kind[1]
        new = _record(sub, sub["pg.table"], table, columns)
        if new is sub:
            return entry
        return {**entry, "type": {**kind, "items": new} if many else ["null", new]}
    if own != table or entry["name"] not in columns:
        return entry
    column = columns[entry["name"]]
    kind = widened(entry["type"], column["type"])
    if kind is entry["type"]:
        return entry
    return {**entry, "type": kind, **{k: v for k, v in column.items() if k == "pg.type"}}


def widened(held: Any, new: Any) -> Any:
    """A type that holds the values of both ``held`` (a view column's: ``["null", ...]``) and ``new`` (the table's
    column's now), branch by branch of their unions; ``held`` itself when it already does or no widening is known."""
    branches = held if isinstance(held, list) else [held]
    out = list(branches)
    for b in new if isinstance(new, list) else [new]:
        if b in out:
            continue
        for i, a in enumerate(out):
            wide = _wider(a, b)
            if wide is not None:
                out[i] = wide
                break
    if out == branches:
        return held
    return out if isinstance(held, list) else out[0]


def _wider(a: Any, b: Any) -> Any:
    """The type of one branch ``a`` widened to hold ``b``'s values too, None when it does not apply to them."""
    if isinstance(a, str) and isinstance(b, str):
        return PROMOTIONS.get((a, b))
    if _decimal(a) and _decimal(b):
        wide = _decimal_of_both(a, b)
        return None if wide == a else wide
    if isinstance(a, dict) and isinstance(b, dict) and a.get("type") == b.get("type") == "array":
        items = widened(a["items"], b["items"])  # numeric[] made numeric(14,3)[]
        return None if items is a["items"] else {**a, "items": items}
    return None


def _decimal(kind: Any) -> bool:
    return isinstance(kind, dict) and kind.get("type") == "bytes" and kind.get("logicalType") == "decimal"


def _decimal_of_both(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """A bytes decimal holding every value of ``a`` and of ``b``: the larger scale, the more whole digits."""
    scale = max(a.get("scale", 0), b.get("scale", 0))
    whole = max(a["precision"] - a.get("scale", 0), b["precision"] - b.get("scale", 0))
    return {**a, "precision": whole + scale, "scale": scale}
