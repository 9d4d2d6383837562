"""The join engine: which view rows a change dirties, the documents, replay and restart."""

from __future__ import annotations

import io
import json
import random
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from streams.fanout import Change
from streams.joins import Joiner, canon, view_schema
from streams.viewstore import MemoryViewStore
from tables.views import TableShape
from tests.tables.test_views import GOOD, SHOP, specs

pytestmark = pytest.mark.unit
KEYS = {t.split(".")[1]: list(s.key) for t, s in SHOP.items()}


def change(op: str, table: str, row: dict[str, Any], lsn: int = 1, before: dict[str, Any] | None = None) -> Change:
    key = json.dumps({k: row[k] for k in KEYS[table]}).encode()
    after = None if op == "DELETE" else json.dumps(row).encode()
    old = None if before is None else json.dumps(before).encode()
    return Change(op, "public", table, table, lsn, 0, key, old, after, 1)


def joiner(store: MemoryViewStore | None = None, text: str = GOOD, cached: int = 1000) -> Joiner:
    return Joiner(specs(text), SHOP, MemoryViewStore() if store is None else store, json.loads, cached)


def shop(j: Joiner) -> None:
    for c in (1, 2):
        j.apply(change("INSERT", "customers", {"id": c, "email": f"{c}@x", "name": f"c{c}", "region": "north"}))
    for p in (10, 11):
        j.apply(change("INSERT", "products", {"id": p, "name": f"p{p}", "category": "toys", "price": "1.50"}))
    j.apply(change("INSERT", "orders", {"id": 100, "customer_id": 1, "status": "paid", "total": "3.00"}))
    for line, product in ((1, 10), (2, 11)):
        j.apply(change("INSERT", "order_items", {"order_id": 100, "line_no": line, "product_id": product,
                                                 "quantity": 1}))  # fmt: skip


def dirty(j: Joiner) -> set[bytes]:
    j.expand()
    found = {key for keys in j.dirty["orders_enriched"].values() for key in keys}
    j.dirty["orders_enriched"].clear()
    return found


def test_a_document_joins_lookups_and_collects_items_in_key_order() -> None:
    j = joiner()
    shop(j)
    doc = j.document("orders_enriched", canon([100]))
    assert doc is not None
    assert doc["customer"]["name"] == "c1"
    assert [(i["line_no"], i["product"]["name"]) for i in doc["items"]] == [(1, "p10"), (2, "p11")]
    assert dirty(j) == {canon([100])}


def test_every_change_dirties_exactly_the_view_rows_it_shows_up_in() -> None:
    j = joiner()
    shop(j)
    j.apply(change("INSERT", "orders", {"id": 101, "customer_id": 2, "status": "paid", "total": "0"}))
    dirty(j)
    j.apply(change("UPDATE", "customers", {"id": 1, "email": "1@x", "name": "renamed", "region": "south"}))
    assert dirty(j) == {canon([100])}
    j.apply(change("UPDATE", "products", {"id": 11, "name": "p11b", "category": "toys", "price": "2"}))
    assert dirty(j) == {canon([100])}
    # an item moves to another order: both orders change
    j.apply(change("UPDATE", "order_items", {"order_id": 101, "line_no": 2, "product_id": 11, "quantity": 1},
                   before={"order_id": 100, "line_no": 2}))  # fmt: skip
    assert dirty(j) == {canon([100]), canon([101])}
    assert [i["line_no"] for i in j.document("orders_enriched", canon([101]))["items"]] == [2]  # type: ignore[index]
    assert [i["line_no"] for i in j.document("orders_enriched", canon([100]))["items"]] == [1]  # type: ignore[index]
    # a foreign key moves the order to its new parent
    j.apply(change("UPDATE", "orders", {"id": 100, "customer_id": 2, "status": "paid", "total": "3.00"}))
    assert dirty(j) == {canon([100])}
    assert j.document("orders_enriched", canon([100]))["customer"]["name"] == "c2"  # type: ignore[index]
    j.apply(change("UPDATE", "customers", {"id": 1, "email": "1@x", "name": "again", "region": "south"}))
    assert dirty(j) == set()  # nobody shows customer 1 any more


def test_deletes_left_and_inner_joins_and_late_parents() -> None:
    j = joiner()
    j.apply(change("INSERT", "orders", {"id": 7, "customer_id": 3, "status": "paid", "total": "0"}))
    j.apply(change("INSERT", "order_items", {"order_id": 7, "line_no": 1, "product_id": 99, "quantity": 1}))
    doc = j.document("orders_enriched", canon([7]))
    assert doc is not None and doc["customer"] is None and doc["items"] == []  # inner product missing: dropped
    dirty(j)
    j.apply(change("INSERT", "customers", {"id": 3, "email": "3@x", "name": "late", "region": "west"}))
    j.apply(change("INSERT", "products", {"id": 99, "name": "late", "category": "toys", "price": "1"}))
    assert dirty(j) == {canon([7])}
    doc = j.document("orders_enriched", canon([7]))
    assert doc is not None and doc["customer"]["name"] == "late" and doc["items"][0]["product"]["name"] == "late"
    j.apply(change("DELETE", "order_items", {"order_id": 7, "line_no": 1}))
    assert dirty(j) == {canon([7])} and j.document("orders_enriched", canon([7]))["items"] == []  # type: ignore[index]
    j.apply(change("DELETE", "customers", {"id": 3}))
    assert j.document("orders_enriched", canon([7]))["customer"] is None  # type: ignore[index]
    j.apply(change("DELETE", "orders", {"id": 7}))
    assert dirty(j) == {canon([7])} and j.document("orders_enriched", canon([7])) is None
    inner = joiner(text=GOOD.replace('"customer: customers', '"customer: inner customers'))
    inner.apply(change("INSERT", "orders", {"id": 8, "customer_id": 4, "status": "paid", "total": "0"}))
    assert inner.document("orders_enriched", canon([8])) is None


def test_truncate_and_key_change_remove_the_old_rows() -> None:
    j = joiner()
    shop(j)
    dirty(j)
    j.apply(change("UPDATE", "orders", {"id": 200, "customer_id": 1, "status": "paid", "total": "3.00"},
                   before={"id": 100}))  # fmt: skip
    assert dirty(j) == {canon([100]), canon([200])}
    assert j.document("orders_enriched", canon([100])) is None
    assert j.document("orders_enriched", canon([200]))["items"] == []  # type: ignore[index]  # items still say 100
    j.apply(Change("TRUNCATE", "public", "customers", "customers", 2, 0, None, None, None, 1))
    assert dirty(j) == {canon([200])} and list(j.keys("public.customers")) == []


def history_of(n: int, seed: int = 7) -> list[Change]:
    rng = random.Random(seed)
    history = []
    for i in range(n):
        table = rng.choice(["customers", "products", "orders", "order_items"])
        if table == "customers":
            row: dict[str, Any] = {"id": rng.randint(1, 5), "email": "e", "name": f"n{i}", "region": "r"}
        elif table == "products":
            row = {"id": rng.randint(1, 5), "name": f"p{i}", "category": "c", "price": str(Decimal(i) / 4)}
        elif table == "orders":
            row = {"id": rng.randint(1, 8), "customer_id": rng.randint(1, 6), "status": "paid", "total": "1"}
        else:
            row = {"order_id": rng.randint(1, 8), "line_no": rng.randint(1, 3), "product_id": rng.randint(1, 6),
                   "quantity": 1}  # fmt: skip
        history.append(change(rng.choice(["INSERT", "UPDATE", "DELETE"]) if i > 50 else "INSERT", table, row))
    return history


def test_restart_from_any_commit_and_replay_give_the_same_state() -> None:
    history = history_of(400)
    whole = MemoryViewStore()
    reference = joiner(whole)
    commits: dict[int, dict[bytes, bytes]] = {}
    for n, c in enumerate(history):
        reference.apply(c)
        whole.commit()
        commits[n] = dict(whole.data)
    # a crash kept the state as of some commit past change 300; replay from change 300 on top of it
    for cut in (300, 301, 350, 398):
        partial = MemoryViewStore()
        partial.data = dict(commits[cut])
        again = joiner(partial, cached=3)  # a small cache: most reads go to the store
        for c in history[300:]:
            again.apply(c)
        partial.commit()
        assert partial.data == whole.data
        for key in set(reference.keys("public.orders")) | set(again.keys("public.orders")):
            assert again.document("orders_enriched", key) == reference.document("orders_enriched", key)


def test_uncommitted_writes_are_read_back_and_lost_with_a_crash() -> None:
    store = MemoryViewStore()
    j = joiner(store)
    shop(j)
    assert j.document("orders_enriched", canon([100])) is not None and store.data == {}
    store.commit()
    held = dict(store.data)
    j.apply(change("DELETE", "orders", {"id": 100}))
    assert j.document("orders_enriched", canon([100])) is None
    store.close()  # a crash: what was not committed is gone
    assert store.data == held and joiner(store).document("orders_enriched", canon([100])) is not None


def test_documents_keep_only_the_listed_columns_and_what_the_joins_need() -> None:
    text = GOOD.replace("on customer_id", "on customer_id (region)").replace("on product_id", "on product_id (name)")
    j = joiner(text=text.replace('base = "orders"', 'base = "orders (status)"'))
    shop(j)
    doc = j.document("orders_enriched", canon([100]))
    assert doc == {"id": 100, "customer_id": 1, "status": "paid",
                   "customer": {"id": 1, "region": "north"},
                   "items": [{"order_id": 100, "line_no": 1, "product_id": 10, "quantity": 1,
                              "product": {"id": 10, "name": "p10"}},
                             {"order_id": 100, "line_no": 2, "product_id": 11, "quantity": 1,
                              "product": {"id": 11, "name": "p11"}}]}  # fmt: skip


def test_view_schema_nests_records_defines_named_types_once_and_round_trips() -> None:
    status = {"type": "enum", "name": "order_status", "namespace": "headwater.pg.public", "symbols": ["a", "b"]}
    decimal = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}

    def table(name: str, fields: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "record", "name": name, "namespace": "headwater.public", "fields": fields}

    values = {
        "public.orders": table("orders", [{"name": "id", "type": "long"}, {"name": "customer_id", "type": "long"},
                                          {"name": "status", "type": status}, {"name": "total", "type": decimal}]),
        "public.customers": table("customers", [{"name": "id", "type": "long"}, {"name": "name", "type": "string"},
                                                {"name": "last_status", "type": ["null", status]}]),
        "public.order_items": table("order_items", [{"name": "order_id", "type": "long"},
                                                    {"name": "line_no", "type": "int"},
                                                    {"name": "product_id", "type": "long"}]),
        "public.products": table("products", [{"name": "id", "type": "long"}, {"name": "price", "type": decimal}]),
    }  # fmt: skip
    (spec,) = specs(GOOD)
    schema = view_schema(spec, values)
    parsed = fastavro.parse_schema(schema)
    doc = {"id": 1, "customer_id": 2, "status": "a", "total": Decimal("3.10"), "hw_commit_lsn": 77,
           "customer": {"id": 2, "name": "x", "last_status": "b"},
           "items": [{"order_id": 1, "line_no": 1, "product_id": 5,
                      "product": {"id": 5, "price": Decimal("1.00")}}]}  # fmt: skip
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parsed, doc)
    back = fastavro.schemaless_reader(io.BytesIO(out.getvalue()), parsed, None)
    assert back == doc
    customer = next(f for f in schema["fields"] if f["name"] == "customer")
    assert customer["type"][1]["fields"][2]["type"] == ["null", "headwater.pg.public.order_status"]
    text = GOOD.replace("on customer_id", "on customer_id (name)").replace("on product_id", "on product_id (id)")
    (slim,) = specs(text)
    keys = {"public.customers": ["id"], "public.products": ["id"], "public.order_items": ["order_id", "line_no"]}
    narrow = view_schema(slim, values, keys)
    customer = next(f for f in narrow["fields"] if f["name"] == "customer")
    assert [f["name"] for f in customer["type"][1]["fields"]] == ["id", "name"]  # the key is always kept
    items = next(f for f in narrow["fields"] if f["name"] == "items")["type"]["items"]
    product = next(f for f in items["fields"] if f["name"] == "product")
    assert [f["name"] for f in product["type"][1]["fields"]] == ["id"]


def test_a_change_two_lookups_away_dirties_the_rows_that_show_it() -> None:
    shapes = {**SHOP, "public.regions": TableShape("public.regions", ("id", "name"), ("id",))}
    shapes["public.customers"] = TableShape("public.customers", ("id", "email", "name", "region"), ("id",))
    (spec,) = specs(
        GOOD.replace(
            '    "customer: customers on customer_id",',
            '    "customer: customers on customer_id",\n    "customer.area: regions on region",',
        )
    )
    spec.check(shapes)
    j = Joiner([spec], shapes, MemoryViewStore(), json.loads)
    region = Change(
        "INSERT", "public", "regions", "regions", 1, 0, b'{"id": "north"}', None, b'{"id": "north", "name": "North"}', 1
    )
    j.apply(region)
    shop(j)
    dirty(j)
    j.apply(
        Change(
            "UPDATE", "public", "regions", "regions", 2, 0, region.key, None, b'{"id": "north", "name": "Far North"}', 1
        )
    )
    assert dirty(j) == {canon([100])}
    assert j.document("orders_enriched", canon([100]))["customer"]["area"]["name"] == "Far North"  # type: ignore[index]
