"""View state split by view partition, pure: each worker keeps what its partitions need and builds them
exactly as one worker keeping everything would."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from streams.fanout import Change
from streams.joins import Joiner, canon, space_name
from streams.placement import Placement, placements
from streams.viewstore import MemoryViewStore
from tests.streams.test_joins import change, history_of
from tests.tables.test_views import COMPOSITE, GOOD, NOTED, SHOP, specs

pytestmark = pytest.mark.unit
PARTITIONS = 4


def partition_of(view: str, values: Any) -> int:
    return int(values[0]) % PARTITIONS


def worker(held: set[int], store: MemoryViewStore | None = None, text: str = GOOD) -> Joiner:
    return Joiner(specs(text), SHOP, store or MemoryViewStore(), json.loads, cached=7, partition_of=partition_of,
                  held=held, partitions=PARTITIONS)  # fmt: skip


def test_the_base_and_its_direct_collects_are_split_lookups_and_deeper_tables_kept_whole() -> None:
    found = placements(specs(GOOD), SHOP)
    assert found == {"public.orders": Placement("orders_enriched", ("id",), True),
                     "public.order_items": Placement("orders_enriched", ("order_id",), True)}  # fmt: skip
    items = '[views.items_view]\nbase = "order_items"\njoins = ["its_order: orders on order_id"]\n'
    both = specs(GOOD + items)
    both[1].check(SHOP)
    assert placements(both, SHOP) == {}  # orders and order_items are used by two views: kept whole


def test_each_worker_builds_its_partitions_as_one_worker_keeping_everything_would() -> None:
    history = history_of(600, seed=11)
    whole = worker({0, 1, 2, 3})
    reference = Joiner(specs(GOOD), SHOP, MemoryViewStore(), json.loads)
    shares = [worker({0, 2}), worker({1}), worker({3})]
    for n, c in enumerate(history):
        for j in (whole, reference, *shares):
            j.apply(c)
        if n % 50 == 49:
            for j in (whole, reference, *shares):
                j.expand()
            for order in range(1, 9):
                key, p = canon([order]), order % PARTITIONS
                expected = reference.document("orders_enriched", key)
                owner = next(j for j in shares if p in j.held)
                assert owner.document("orders_enriched", key, p) == expected
                assert whole.document("orders_enriched", key, p) == expected
    for j in shares:  # a worker keeps the split tables' rows of its partitions only
        for table in ("public.orders", "public.order_items"):
            assert not any(list(j.keys(table, space)) for space in range(PARTITIONS) if space not in j.held)
        assert any(list(j.keys("public.orders", space)) for space in j.held)
        assert sorted(j.keys("public.products")) == sorted(reference.keys("public.products"))  # replicated


def test_every_view_row_that_changes_is_dirty_on_the_worker_holding_it_and_nowhere_else() -> None:
    history = history_of(500, seed=4)
    reference = Joiner(specs(GOOD), SHOP, MemoryViewStore(), json.loads)
    shares = [worker({0, 1}), worker({2, 3})]
    shown: dict[bytes, Any] = {}
    for c in history:
        for j in (reference, *shares):
            j.apply(c)
        for j in shares:
            j.expand()
        for order in range(1, 9):
            key, p = canon([order]), order % PARTITIONS
            now = reference.document("orders_enriched", key)
            owner, other = shares if p in shares[0].held else shares[::-1]
            if now != shown.get(key):
                assert key in owner.dirty["orders_enriched"].get(p, set()), (c, order)
            assert key not in other.dirty["orders_enriched"].get(p, set())
            shown[key] = now
        for j in shares:
            j.dirty["orders_enriched"].clear()


def test_an_item_moving_to_an_order_of_another_partition_leaves_one_and_joins_the_other() -> None:
    first, second = worker({0}), worker({1})
    for j in (first, second):
        for order in (4, 5):  # partitions 0 and 1
            j.apply(change("INSERT", "orders", {"id": order, "customer_id": 1, "status": "paid", "total": "1"}))
        j.apply(change("INSERT", "products", {"id": 9, "name": "p", "category": "c", "price": "1"}))
        j.apply(change("INSERT", "order_items", {"order_id": 4, "line_no": 1, "product_id": 9, "quantity": 1}))
        j.expand()
        j.dirty["orders_enriched"].clear()
    moved = change("UPDATE", "order_items", {"order_id": 5, "line_no": 1, "product_id": 9, "quantity": 1},
                   before={"order_id": 4, "line_no": 1})  # fmt: skip
    for j in (first, second):
        j.apply(moved)
    assert first.dirty["orders_enriched"] == {0: {canon([4])}}
    assert second.dirty["orders_enriched"] == {1: {canon([5])}}
    assert first.document("orders_enriched", canon([4]), 0)["items"] == []  # type: ignore[index]
    assert [i["line_no"] for i in second.document("orders_enriched", canon([5]), 1)["items"]] == [1]  # type: ignore[index]
    assert list(first.keys("public.order_items", 0)) == [] and list(second.keys("public.order_items", 1))


def test_a_space_that_is_not_live_skips_the_change() -> None:
    j = worker({0, 1})
    j.apply(change("INSERT", "orders", {"id": 4, "customer_id": 1, "status": "paid", "total": "1"}),
            live=lambda space: space != 0)  # partition 0's state is past this change already
    assert list(j.keys("public.orders", 0)) == []
    j.apply(change("INSERT", "customers", {"id": 1, "email": "e", "name": "n", "region": "r"}), live=lambda s: False)
    assert list(j.keys("public.customers")) == []
    assert space_name("public.orders", 3) != space_name("public.orders", None)


def test_rows_split_by_key_of_partitions_held_elsewhere_are_dropped_before_their_row_is_decoded() -> None:
    decoded: list[bytes] = []

    def decode(data: bytes) -> Any:
        decoded.append(data)
        return json.loads(data)

    def from_image(view: str, image: bytes) -> int | None:  # what the materializer reads off a key's frame
        return None if image.startswith(b"{") else int(image) % PARTITIONS

    j = Joiner(specs(GOOD), SHOP, MemoryViewStore(), decode, partition_of=partition_of, held={1}, partitions=PARTITIONS,
               image_partition=from_image)  # fmt: skip
    order = {"id": 6, "customer_id": 1, "status": "paid", "total": "1"}
    j.apply(Change("INSERT", "public", "orders", "orders", 1, 0, b"6", None, json.dumps(order).encode(), 1))
    j.apply(change("UPDATE", "orders", order))  # a JSON key image: read to tell the partition
    j.apply(change("INSERT", "order_items", {"order_id": 6, "line_no": 1, "product_id": 1, "quantity": 1}))
    assert decoded == [b'{"id": 6}', b'{"order_id": 6, "line_no": 1}']  # the keys only, never a row
    assert not any(list(j.keys(t, p)) for t in ("public.orders", "public.order_items") for p in range(PARTITIONS))
    j.apply(change("UPDATE", "order_items", {"order_id": 5, "line_no": 1, "product_id": 1, "quantity": 1},
                   before={"order_id": 6, "line_no": 1}))  # a key that moves is read whole: it comes to partition 1
    assert list(j.keys("public.order_items", 1)) == [canon([5, 1])]
    fifth = json.dumps({**order, "id": 5}).encode()
    j.partition_of = lambda view, values: 1 // 0  # a held row placed by its key image is not placed again
    j.apply(Change("INSERT", "public", "orders", "orders", 2, 0, b"5", None, fifth, 1))
    assert list(j.keys("public.orders", 1)) == [canon([5])]
    everywhere = Joiner(specs(GOOD), SHOP, MemoryViewStore(), json.loads, partition_of=lambda view, values: 1 // 0,
                        held={0, 1, 2, 3}, partitions=PARTITIONS, image_partition=from_image)  # fmt: skip
    everywhere.apply(Change("INSERT", "public", "orders", "orders", 1, 0, b"6", None, json.dumps(order).encode(), 1))
    assert list(everywhere.keys("public.orders", 2)) == [canon([6])]  # holding every partition: placed by its image
    everywhere.partition_of = partition_of
    everywhere.apply(change("INSERT", "order_items", {"order_id": 6, "line_no": 1, "product_id": 1, "quantity": 1}))
    assert list(everywhere.keys("public.order_items", 2)) == [canon([6, 1])]  # not the base: placed by its row


def noted_change(rng: random.Random, n: int) -> tuple[str, str, dict[str, Any]]:
    """A random change of the composite-key shop: (op, table, row)."""
    table = rng.choice(["orders", "warehouses", "order_items", "item_notes"])
    if table == "orders":
        row: dict[str, Any] = {"id": rng.randint(1, 6), "customer_id": 1, "status": "paid", "total": "1",
                               "region": rng.choice(["n", "s", None]), "wh_code": rng.choice(["a", "b"])}  # fmt: skip
    elif table == "warehouses":
        row = {"region": rng.choice(["n", "s"]), "code": rng.choice(["a", "b"]), "name": f"w{n}"}
    elif table == "order_items":
        row = {"order_id": rng.randint(1, 6), "line_no": rng.randint(1, 2), "product_id": 1, "quantity": n}
    else:
        row = {"order_id": rng.randint(1, 6), "line_no": rng.randint(1, 2), "n": rng.randint(1, 3), "body": f"b{n}"}
    return rng.choice(["INSERT", "UPDATE", "DELETE"]) if n > 40 else "INSERT", table, row


def oracle(tables: dict[str, dict[tuple[Any, ...], dict[str, Any]]], key: tuple[Any, ...]) -> dict[str, Any] | None:
    """The items_noted document of one item, computed from the rows by scanning (no indexes)."""
    item = tables["order_items"].get(key)
    if item is None:
        return None
    notes = sorted((k, r) for k, r in tables["item_notes"].items() if k[:2] == key)
    order = tables["orders"].get((item["order_id"],))
    doc: dict[str, Any] = {**item, "notes": [{c: r[c] for c in ("order_id", "line_no", "n", "body")} for _, r in notes],
                           "order": None if order is None else {**order, "warehouse": None}}  # fmt: skip
    if order is not None and order["region"] is not None:
        found = tables["warehouses"].get((order["region"], order["wh_code"]))
        doc["order"]["warehouse"] = found
    return doc


def test_composite_lookups_and_collects_match_a_scan_of_the_rows_split_or_not() -> None:
    keys = {"orders": ("id",), "warehouses": ("region", "code"), "order_items": ("order_id", "line_no"),
            "item_notes": ("order_id", "line_no", "n")}  # fmt: skip

    def make(held: set[int] | None) -> Joiner:
        partition = None if held is None else (lambda view, values: (values[0] + values[1]) % PARTITIONS)
        return Joiner(specs(NOTED), COMPOSITE, MemoryViewStore(), json.loads, cached=5, partition_of=partition,
                      held=held, partitions=PARTITIONS)  # fmt: skip

    whole, shares = make(None), [make({0, 3}), make({1, 2})]
    assert set(shares[0].placed) == {"public.order_items", "public.item_notes"}
    tables: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {t: {} for t in keys}
    rng = random.Random(8)
    for n in range(500):
        op, table, row = noted_change(rng, n)
        key = tuple(row[c] for c in keys[table])
        if op == "DELETE":
            tables[table].pop(key, None)
        else:
            tables[table][key] = row
        c = Change(op, "public", table, table, n, 0, json.dumps(dict(zip(keys[table], key, strict=True))).encode(),
                   None, None if op == "DELETE" else json.dumps(row).encode(), 1)  # fmt: skip
        for j in (whole, *shares):
            j.apply(c)
        for item in ((o, line) for o in range(1, 7) for line in (1, 2)):
            expected = oracle(tables, item)
            assert whole.document("items_noted", canon(list(item))) == expected, (n, item)
            p = (item[0] + item[1]) % PARTITIONS
            owner = next(j for j in shares if p in j.held)
            assert owner.document("items_noted", canon(list(item)), p) == expected, (n, item)
