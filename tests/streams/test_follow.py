"""A view's schema widened to what its tables' columns hold after an ALTER ... TYPE, and nothing else."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import fastavro
import pytest

from streams.docbytes import Encoders
from streams.follow import follow, widened
from streams.joins import view_schema
from tests.streams.test_docbytes import PRICE, VALUES
from tests.tables.test_views import GOOD, SHOP, specs

pytestmark = pytest.mark.unit
WIDER = {**PRICE, "precision": 14, "scale": 3}


def schema() -> dict[str, Any]:
    (spec,) = specs(GOOD)
    return view_schema(spec, VALUES, {q: s.key for q, s in SHOP.items()})


def product(record: dict[str, Any]) -> dict[str, Any]:
    """The products record inside the view's items."""
    items = next(f for f in record["fields"] if f["name"] == "items")["type"]["items"]
    return next(f for f in items["fields"] if f["name"] == "product")["type"][1]


def column(record: dict[str, Any], name: str) -> Any:
    return next(f for f in record["fields"] if f["name"] == name)["type"]


@pytest.mark.parametrize(("held", "new", "wide"), [
    (["null", PRICE], WIDER, ["null", WIDER]),
    (["null", PRICE, "string"], [WIDER, "string"], ["null", WIDER, "string"]),  # numeric as capture writes it
    (["null", PRICE], {**PRICE, "precision": 10, "scale": 4}, ["null", {**PRICE, "precision": 14, "scale": 4}]),
    (["null", "int"], "long", ["null", "long"]),
    (["null", "float"], ["null", "double"], ["null", "double"]),
    ("int", "long", "long"),
    (["null", {"type": "array", "items": ["null", PRICE]}], {"type": "array", "items": ["null", WIDER]},
     ["null", {"type": "array", "items": ["null", WIDER]}]),
])  # fmt: skip
def test_a_column_is_widened_to_hold_the_values_of_both_types(held: Any, new: Any, wide: Any) -> None:
    assert widened(held, new) == wide


@pytest.mark.parametrize(("held", "new"), [
    (["null", WIDER], PRICE),  # an older change replayed: nothing narrows
    (["null", "long"], "int"),
    (["null", "long"], "double"),  # not exact past 2**53
    (["null", "int"], "float"),  # not exact past 2**24
    (["null", PRICE], PRICE),
    (["null", "string"], "long"),  # not a widening it knows
    (["null", {"type": "enum", "name": "e", "symbols": ["a"]}], {"type": "enum", "name": "e", "symbols": ["a", "b"]}),
])  # fmt: skip
def test_a_column_that_already_holds_the_values_or_that_no_widening_fits_is_left_as_it_is(held: Any, new: Any) -> None:
    assert widened(held, new) is held


def test_a_view_follows_its_joined_tables_columns_and_leaves_every_other_record_alone() -> None:
    before = schema()
    products = {f["name"]: f for f in VALUES["public.products"]["fields"]}
    price = {"name": "price", "type": [WIDER, "string"], "pg.type": "numeric(14,3)"}
    after = follow(before, "public.products", {**products, "price": price})
    assert column(product(after), "price") == ["null", WIDER]
    assert next(f for f in product(after)["fields"] if f["name"] == "price")["pg.type"] == "numeric(14,3)"
    assert column(product(before), "price") == ["null", PRICE], "the schema followed is not changed in place"
    assert column(after, "total") == ["null", PRICE], "the orders' own decimal column is another table's"
    assert [f["name"] for f in product(after)["fields"]] == [f["name"] for f in product(before)["fields"]]
    fastavro.parse_schema(after)
    encoders = Encoders(after)  # rows decoded under both types are written exactly
    row = {"id": 1, "name": "n", "category": "c"}
    old = encoders.own("items[].product", {**row, "price": Decimal("1.50")})
    new = encoders.own("items[].product", {**row, "price": Decimal("1.505")})
    assert old != new


def test_a_view_that_already_holds_the_types_is_the_same_object() -> None:
    before = schema()
    products = {f["name"]: f for f in VALUES["public.products"]["fields"]}
    assert follow(before, "public.products", products) is before
    assert follow(before, "public.customers", {"name": {"type": "long"}}) is before  # string to long: no widening
    assert follow(before, "public.products", {"added": {"type": "long"}}) is before  # a new column: after a restart


def test_base_table_columns_are_followed_too() -> None:
    before = schema()
    after = follow(before, "public.orders", {"total": {"type": WIDER}, "id": {"type": "long"}})
    assert column(after, "total") == ["null", WIDER]
    assert column(product(after), "price") == ["null", PRICE]


def test_a_row_that_does_not_fit_names_the_view_and_its_path_and_not_the_values() -> None:
    encoders = Encoders(schema())
    row = {"id": 1, "name": "n", "category": "c", "price": Decimal("1.505")}
    with pytest.raises(ValueError, match=r"view orders_enriched, items\[\]\.product: a row does not fit") as caught:
        encoders.own("items[].product", row)
    assert "1.505" not in str(caught.value)
