"""View rows' contents put together from their rows' own encodings: byte for byte fastavro's."""

from __future__ import annotations

import io
import pickle
import random
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from streams.docbytes import Encoders, long_bytes
from streams.fanout import Change
from streams.joins import Joiner, canon, view_schema
from streams.viewstore import MemoryViewStore
from tables.flatavro import reader
from tables.views import LSN_FIELD
from tables.wire import avro_body
from tests.streams.test_joins import KEYS
from tests.tables.test_views import GOOD, SHOP, specs

pytestmark = pytest.mark.unit
STATUS = {"type": "enum", "name": "order_status", "namespace": "headwater.pg.public", "symbols": ["paid", "sent"]}
PRICE = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}


def record(name: str, fields: list[tuple[str, Any]]) -> dict[str, Any]:
    return {"type": "record", "name": name, "namespace": "headwater.public",
            "fields": [{"name": n, "type": t} for n, t in fields]}  # fmt: skip


VALUES = {
    "public.orders": record("orders", [("id", "long"), ("customer_id", ["null", "long"]), ("status", STATUS),
                                       ("total", PRICE)]),
    "public.customers": record("customers", [("id", "long"), ("email", "string"), ("name", "string"),
                                             ("region", ["null", "string"])]),
    "public.order_items": record("order_items", [("order_id", "long"), ("line_no", "int"), ("product_id", "long"),
                                                 ("quantity", "int")]),
    "public.products": record("products", [("id", "long"), ("name", "string"), ("category", "string"),
                                           ("price", PRICE)]),
}  # fmt: skip


def change(op: str, table: str, row: dict[str, Any]) -> Change:
    key = pickle.dumps({k: row[k] for k in KEYS[table]})
    return Change(op, "public", table, table, 1, 0, key, None, None if op == "DELETE" else pickle.dumps(row), 1)


def random_change(rng: random.Random, n: int) -> Change:
    table = rng.choice(["customers", "products", "orders", "order_items"])
    if table == "customers":
        row: dict[str, Any] = {"id": rng.randint(1, 4), "email": "e", "name": f"n{n}",
                               "region": rng.choice([None, "north"])}  # fmt: skip
    elif table == "products":
        row = {"id": rng.randint(1, 4), "name": f"p{n}", "category": "c", "price": Decimal(n) / 4}
    elif table == "orders":
        row = {"id": rng.randint(1, 6), "customer_id": rng.choice([None, *range(1, 6)]),
               "status": rng.choice(["paid", "sent"]), "total": Decimal("1.10")}  # fmt: skip
    else:
        row = {"order_id": rng.randint(1, 6), "line_no": rng.randint(1, 3), "product_id": rng.randint(1, 5),
               "quantity": n}  # fmt: skip
    return change(rng.choice(["INSERT", "UPDATE", "DELETE"]) if n > 30 else "INSERT", table, row)


@pytest.mark.parametrize("text", [
    GOOD,  # every column, an inner lookup inside a collect
    GOOD.replace("on customer_id", "on customer_id (region)").replace('"orders"', '"orders (status)"')
        .replace("inner products on product_id", "products on product_id (price)"),  # column lists
])  # fmt: skip
@pytest.mark.parametrize("cached", [5, 1000])  # most rows and contents read again, or all kept
@pytest.mark.parametrize("split", [False, True])  # every table in one space, or the orders and items in two
def test_a_content_is_the_documents_avro_without_its_lsn_after_every_change(text: str, cached: int,
                                                                             split: bool) -> None:  # fmt: skip
    (spec,) = specs(text)
    schema = view_schema(spec, VALUES, {q: s.key for q, s in SHOP.items()})
    parsed = fastavro.parse_schema(schema)
    encoders, documents = Encoders(schema), reader(parsed)
    assert documents is not None
    assert all(compiled is not None for compiled in encoders.compiled.values()), "own rows encoded in C"
    placed: dict[str, Any] = {"partition_of": lambda view, values: values[0] % 2, "held": {0, 1},
                              "partitions": 2} if split else {}  # fmt: skip
    joiner = Joiner([spec], SHOP, MemoryViewStore(), pickle.loads, cached=cached, encoders={spec.name: encoders},
                    **placed)  # fmt: skip
    rng = random.Random(3)
    for n in range(300):
        joiner.apply(random_change(rng, n))
        for order in range(1, 7):
            key, partition = canon([order]), order % 2 if split else 0
            doc = joiner.document(spec.name, key, partition)
            expected = None if doc is None else avro_body(parsed, {**doc, LSN_FIELD: 0})[:-1]
            assert joiner.content(spec.name, key, partition) == expected, (n, doc)
            if expected is not None:  # and the document reads back in C (the Redis mirror) as fastavro reads it
                assert documents.read(expected + b"\x00") == fastavro.schemaless_reader(
                    io.BytesIO(expected + b"\x00"), parsed, None)  # fmt: skip


def test_avro_longs_zig_zag_and_take_seven_bits_a_byte() -> None:
    for n in (0, 1, -1, 63, 64, 300, -300, 2**40, -(2**62)):
        assert long_bytes(n) == avro_body(fastavro.parse_schema("long"), n)
