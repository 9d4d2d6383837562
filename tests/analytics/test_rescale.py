"""Decimals written under one scale read as the newest schema's scale means them."""

from __future__ import annotations

import io
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from analytics.rescale import rescaler
from tables.avro import plain

pytestmark = pytest.mark.unit


def dec(precision: int, scale: int) -> dict[str, Any]:
    return {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}


def view(price: Any) -> dict[str, Any]:
    """A view-like record: a nullable numeric column in a collect's lookup."""
    fields = [{"name": "id", "type": "long"}, {"name": "price", "type": ["null", price, "string"]}]
    product = {"type": "record", "name": "product", "pg.table": "public.products", "fields": fields}
    item = {"type": "record", "name": "item", "fields": [{"name": "product", "type": ["null", product]}]}
    return {"type": "record", "name": "v", "fields": [
        {"name": "total", "type": ["null", dec(12, 2)]},
        {"name": "items", "type": {"type": "array", "items": item}}]}  # fmt: skip


def read_as_newest(writer: dict[str, Any], newest: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """Written with ``writer``'s types, read raw (as the source does), rescaled, then given ``newest``'s meaning."""
    data = io.BytesIO()
    fastavro.schemaless_writer(data, fastavro.parse_schema(writer), doc)
    raw = fastavro.schemaless_reader(io.BytesIO(data.getvalue()), fastavro.parse_schema(plain(writer)),
                                     fastavro.parse_schema(plain(newest)))  # fmt: skip
    convert = rescaler(writer, newest)
    again = io.BytesIO()
    fastavro.schemaless_writer(again, fastavro.parse_schema(plain(newest)), raw if convert is None else convert(raw))
    return dict(fastavro.schemaless_reader(io.BytesIO(again.getvalue()), fastavro.parse_schema(newest)))  # type: ignore[arg-type]


def doc(*prices: Any) -> dict[str, Any]:
    return {"total": Decimal("9.99"), "items": [{"product": {"id": n, "price": p}} for n, p in enumerate(prices)]}


def test_a_decimal_written_under_a_smaller_scale_keeps_its_value_under_the_newest() -> None:
    got = read_as_newest(view(dec(12, 2)), view(dec(14, 3)), doc(Decimal("1.50"), Decimal("-627.01"), None, "NaN"))
    assert [i["product"]["price"] for i in got["items"]] == [Decimal("1.500"), Decimal("-627.010"), None, "NaN"]
    assert got["total"] == Decimal("9.99")


def test_a_smaller_newest_scale_rounds_half_away_from_zero_as_postgresql_casts() -> None:
    got = read_as_newest(view(dec(14, 3)), view(dec(12, 2)), doc(Decimal("1.505"), Decimal("-1.505"), Decimal("1.504")))
    assert [i["product"]["price"] for i in got["items"]] == [Decimal("1.51"), Decimal("-1.51"), Decimal("1.50")]


def test_a_lookup_that_is_null_and_a_record_of_the_newest_schema_pass_as_they_are() -> None:
    got = read_as_newest(view(dec(12, 2)), view(dec(14, 3)), {"total": None, "items": [{"product": None}]})
    assert got == {"total": None, "items": [{"product": None}]}
    assert rescaler(view(dec(12, 2)), view(dec(12, 2))) is None
    assert rescaler(view(dec(12, 2)), view(dec(14, 2))) is None  # more whole digits: the same unscaled integer


def test_a_table_column_not_nullable_is_rescaled_too() -> None:
    table = {"type": "record", "name": "t", "fields": [{"name": "price", "type": dec(10, 2)}]}
    wider = {"type": "record", "name": "t", "fields": [{"name": "price", "type": dec(12, 4)}]}
    assert read_as_newest(table, wider, {"price": Decimal("-0.01")}) == {"price": Decimal("-0.0100")}


def test_a_key_written_under_the_old_scale_reads_as_the_newest_value_schema_means_its_columns() -> None:
    """A tombstone's row is its key: its decimal columns are moved to the value schema's scale by name."""
    key = {"type": "record", "name": "k", "fields": [{"name": "price", "type": dec(10, 2)}]}
    value = {"type": "record", "name": "t", "fields": [{"name": "id", "type": "long"},
                                                       {"name": "price", "type": dec(12, 3)}]}  # fmt: skip
    convert = rescaler(key, value)
    assert convert is not None
    unscaled = [n.to_bytes(2, "big", signed=True) for n in (150, 1500)]
    assert convert({"price": unscaled[0]}) == {"price": unscaled[1]}
