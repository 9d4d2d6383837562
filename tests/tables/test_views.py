"""View specs: the join syntax, and every spec error names the file, the line and the fix."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tables.errors import ConfigError
from tables.views import TableShape, ViewSpec, parse_views

pytestmark = pytest.mark.unit

SHOP = {
    "public.customers": TableShape("public.customers", ("id", "email", "name", "region"), ("id",)),
    "public.products": TableShape("public.products", ("id", "name", "category", "price"), ("id",)),
    "public.orders": TableShape("public.orders", ("id", "customer_id", "status", "total"), ("id",)),
    "public.order_items": TableShape(
        "public.order_items", ("order_id", "line_no", "product_id", "quantity"), ("order_id", "line_no")
    ),
}
GOOD = """\
[views.orders_enriched]
base = "orders"
joins = [
    "customer: customers on customer_id",
    "items[]: order_items on order_id",
    "items[].product: inner products on product_id",
]
"""


def specs(text: str, path: Path | None = None) -> list[ViewSpec]:
    return parse_views(tomllib.loads(text), text, path)


def error(text: str, tmp_path: Path) -> ConfigError:
    path = tmp_path / "headwater.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        for spec in specs(text, path):
            spec.check(SHOP)
    assert str(path) in str(caught.value)
    return caught.value


def test_the_shop_view_reads_as_a_tree_of_joins() -> None:
    (spec,) = specs(GOOD)
    spec.check(SHOP)
    assert spec.base == "public.orders"
    customer, items, product = spec.joins
    assert (customer.name, customer.many, customer.inner, customer.parent) == ("customer", False, False, "")
    assert (items.name, items.many, items.table, items.on) == ("items", True, "public.order_items", ("order_id",))
    assert (product.name, product.parent, product.inner, product.line) == ("product", "items[]", True, 6)
    assert spec.tables == set(SHOP)


def test_column_lists_keep_what_is_listed_plus_keys_and_join_columns() -> None:
    (spec,) = specs("""\
[views.slim]
base = "orders (status)"
joins = [
    "customer: customers on customer_id (region)",
    "items[]: order_items on order_id (quantity)",
    "items[].product: inner products on product_id ( category , price )",
]
""")
    spec.check(SHOP)
    assert spec.columns == ("status",) and spec.joins[2].columns == ("category", "price")
    assert spec.kept("", SHOP["public.orders"]) == ("id", "customer_id", "status")  # key, lookup column, listed
    assert spec.kept("customer", SHOP["public.customers"]) == ("id", "region")
    assert spec.kept("items[]", SHOP["public.order_items"]) == ("order_id", "line_no", "product_id", "quantity")
    assert spec.kept("items[].product", SHOP["public.products"]) == ("id", "category", "price")
    (whole,) = specs(GOOD)
    assert whole.kept("", SHOP["public.orders"]) == SHOP["public.orders"].columns
    sql = spec.sql(SHOP)
    assert "jsonb_build_object('id', t0.\"id\", 'customer_id', t0.\"customer_id\", 'status', t0.\"status\")" in sql
    assert "to_jsonb(" not in sql and "to_jsonb(" in whole.sql(SHOP)


@pytest.mark.parametrize(
    ("base", "join", "words"),
    [
        ("orders (nope)", "customer: customers on customer_id", ["the base: public.orders has no column 'nope'"]),
        ("orders", "customer: customers on customer_id (id, mail)", ["customers has no column 'mail'"]),
        ("orders", "customer: customers on customer_id ()", ["list the columns to keep"]),
        ("orders", "customer: customers on customer_id (id, id)", ["a column is listed twice"]),
        ("orders (id", "customer: customers on customer_id", ["cannot read base", "(columns to keep)"]),
    ],
)  # fmt: skip
def test_a_bad_column_list_fails_naming_its_line(base: str, join: str, words: list[str], tmp_path: Path) -> None:
    text = f'# the shop\n[views.v]\nbase = "{base}"\njoins = [\n    "{join}",\n]\n'
    caught = error(text, tmp_path)
    assert all(w in str(caught) for w in words), str(caught)
    assert caught.line in (2, 5)


@pytest.mark.parametrize(
    ("join", "words"),
    [
        ("customer: clients on customer_id", ["public.clients is not captured", "captured: public.customers"]),
        ("customer: customers on client_id", ["public.orders has no column 'client_id'"]),
        ("lines[]: order_items on item_order", ["public.order_items has no column 'item_order'"]),
        ("customer: customers on customer_id = email", ["not its key (id)", "index of its own"]),
        ("line: order_items on id", ["composite key (order_id, line_no)"]),
        ("status: customers on customer_id", ["'status' is already a column of public.orders"]),
        ("customer: customers on customer_id\",\n    \"customer.again: orders on id",
         ["joins public.orders back into its own path", "a cycle"]),
        ("customer customers on customer_id", ["cannot read the join", "<path>: [left|inner] <table> on <column>"]),
        ("items[].product: products on product_id", ["its parent 'items[]' must be declared before it"]),
    ],
)  # fmt: skip
def test_a_bad_join_fails_naming_its_line(join: str, words: list[str], tmp_path: Path) -> None:
    text = f'# the shop\n[views.v]\nbase = "orders"\njoins = [\n    "{join}",\n]\n'
    exc = error(text, tmp_path)
    for word in words:
        assert word in str(exc), str(exc)
    assert exc.line is not None and exc.line >= 5, str(exc)


def test_unknown_base_table_key_and_view_name_fail_with_the_header_line(tmp_path: Path) -> None:
    assert error('[views.v]\nbase = "nothing"\n', tmp_path).line == 1
    exc = error('\n[views.v]\nbase = "orders"\nfilter = "x"\n', tmp_path)
    assert "unknown key 'filter'" in str(exc) and exc.line == 2
    assert "needs base" in str(error("[views.v]\njoins = []\n", tmp_path))
    assert "view names are letters" in str(error('[views."my view"]\nbase = "orders"\n', tmp_path))


def test_duplicate_paths_are_refused(tmp_path: Path) -> None:
    text = '[views.v]\nbase = "orders"\njoins = ["c: customers on customer_id", "c: customers on customer_id"]\n'
    assert "declared twice" in str(error(text, tmp_path))


COMPOSITE = {
    **SHOP,
    "public.orders": TableShape("public.orders", ("id", "customer_id", "status", "total", "region", "wh_code"),
                                ("id",)),
    "public.warehouses": TableShape("public.warehouses", ("region", "code", "name"), ("region", "code")),
    "public.item_notes": TableShape("public.item_notes", ("order_id", "line_no", "n", "body"),
                                    ("order_id", "line_no", "n")),
}  # fmt: skip
NOTED = """\
[views.items_noted]
base = "order_items"
joins = [
    "notes[]: item_notes on (order_id, line_no) (body)",
    "order: orders on order_id",
    "order.warehouse: warehouses on (region, wh_code) = (region, code)",
]
"""


def test_joins_on_composite_keys_name_every_column_in_the_keys_order() -> None:
    (spec,) = specs(NOTED)
    spec.check(COMPOSITE)
    notes, order, warehouse = spec.joins
    assert order.on == ("order_id",) and not order.many
    assert (notes.on, notes.many, notes.columns) == (("order_id", "line_no"), True, ("body",))
    assert (warehouse.on, warehouse.target) == (("region", "wh_code"), ("region", "code"))
    assert spec.kept("notes[]", COMPOSITE["public.item_notes"]) == ("order_id", "line_no", "n", "body")
    assert spec.kept("order", COMPOSITE["public.orders"]) == COMPOSITE["public.orders"].columns
    sql = spec.sql(COMPOSITE)
    assert 't1."order_id" = t0."order_id" AND t1."line_no" = t0."line_no"' in sql
    assert 't3."region" = t2."region" AND t3."code" = t2."wh_code"' in sql


@pytest.mark.parametrize(
    ("join", "words"),
    [
        ("notes[]: item_notes on order_id", ["composite key (order_id, line_no)", "'on (order_id, line_no)'"]),
        ("wh: warehouses on (region, nope)", ["has no column 'nope'"]),
        ("wh: warehouses on (region, wh_code) = (code, region)", ["not its key (region, code)"]),
        ("wh: warehouses on ()", ["name the columns to join on"]),
        ("o: orders on (order_id, line_no)", ["a key (id)", "got order_id, line_no"]),
    ],
)  # fmt: skip
def test_a_composite_join_that_does_not_match_the_key_fails_naming_its_line(join: str, words: list[str],
                                                                          tmp_path: Path) -> None:  # fmt: skip
    base = "order_items" if join.startswith(("notes", "o:")) else "orders"
    text = f'# composite\n[views.v]\nbase = "{base}"\njoins = [\n    "{join}",\n]\n'
    path = tmp_path / "headwater.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        for spec in specs(text, path):
            spec.check(COMPOSITE)
    for word in words:
        assert word in str(caught.value), str(caught.value)
    assert caught.value.line == 5
