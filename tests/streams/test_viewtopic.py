"""A view topic's values: the content a row is compared by, and the commit LSN appended to it."""

from __future__ import annotations

import pytest

from streams.catalog import KeyCodec
from streams.joins import view_schema
from streams.viewtopic import ViewTopic
from tables.wire import frame
from tests.streams.test_joins import GOOD, specs

pytestmark = pytest.mark.unit


def table(name: str, fields: list[str]) -> dict[str, object]:
    return {"type": "record", "name": name, "namespace": "headwater.public",
            "fields": [{"name": f, "type": ["null", "string"] if f == "name" else "long"} for f in fields]}  # fmt: skip


VALUES = {
    "public.orders": table("orders", ["id", "customer_id"]),
    "public.customers": table("customers", ["id", "name"]),
    "public.order_items": table("order_items", ["order_id", "line_no", "product_id"]),
    "public.products": table("products", ["id", "name"]),
}
KEY = {"type": "record", "name": "orders_key", "fields": [{"name": "id", "type": "long"}]}


def view() -> ViewTopic:
    (spec,) = specs(GOOD)
    return ViewTopic(spec, "p.views.v", view_schema(spec, VALUES), frame(7), frame(8), KeyCodec(8, KEY))


DOC = {"id": 1, "customer_id": 2, "customer": {"id": 2, "name": "x"},
       "items": [{"order_id": 1, "line_no": 1, "product_id": 5, "product": {"id": 5, "name": None}}]}  # fmt: skip


@pytest.mark.parametrize("lsn", [0, 1, 63, 64, 8191, 8192, 0x16B3748, 2**40 + 5, 2**62])
def test_a_value_is_its_content_and_the_lsn_and_reads_back_as_one(lsn: int) -> None:
    v = view()
    value = v.at(v.content(DOC), lsn)
    assert value == v.encode(DOC, lsn)
    assert v.decode(value) == {**DOC, "hw_commit_lsn": lsn}
    assert v.content_of(value, lsn) == v.content(DOC)


def test_content_tells_changed_rows_apart_and_a_foreign_lsn_is_not_stripped() -> None:
    v = view()
    other = {**DOC, "customer": {"id": 2, "name": "y"}}
    assert v.content(other) != v.content(DOC)
    assert v.content_of(v.encode(DOC, 300), 301) is None


def test_a_schema_without_the_lsn_last_is_refused() -> None:
    v = view()
    schema = {**v.schema, "fields": v.schema["fields"][::-1]}
    with pytest.raises(RuntimeError, match="hw_commit_lsn must be the schema's last field"):
        ViewTopic(v.spec, v.topic, schema, v.value_frame, v.key_frame, v.codec)


def test_a_base_rows_key_record_is_the_view_key_under_the_views_key_frame() -> None:
    base = view()
    v = ViewTopic(base.spec, base.topic, base.schema, base.value_frame, frame(9), base.codec)  # the view's key subject
    assert v.codec.encode_text("300") == frame(8) + b"\xd8\x04"
    assert v.key_of_base_key(v.codec.encode_text("300")) == v.key({**DOC, "id": 300}) == frame(9) + b"\xd8\x04"
