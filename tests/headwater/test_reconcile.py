"""Reconciliation's rebuild of the raw topic (pure): rows are known by their key's values, whatever key schema
framed them."""

from __future__ import annotations

import io
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from headwater.reconcile import apply_changes
from tables.wire import avro_body, frame, schema_id

SCHEMAS = {
    1: {"type": "record", "name": "K", "fields": [{"name": "id", "type": {"type": "bytes", "logicalType": "decimal",
                                                                         "precision": 10, "scale": 2}}]},
    2: {"type": "record", "name": "K", "fields": [{"name": "id", "type": {"type": "bytes", "logicalType": "decimal",
                                                                         "precision": 10, "scale": 3}}]},
    3: {"type": "record", "name": "K", "fields": [{"name": "id", "type": "int"}]},
    4: {"type": "record", "name": "K", "fields": [{"name": "id", "type": "long"}]},
    5: {"type": "record", "name": "R", "fields": [{"name": "id", "type": "long"}, {"name": "v", "type": "string"}]},
}  # fmt: skip


class Schemas:
    """The registry's reads that ``apply_changes`` makes, over ``SCHEMAS`` (a pure test: no registry here)."""

    def parsed(self, ident: int) -> Any:
        return fastavro.parse_schema(SCHEMAS[ident])

    def decode(self, data: bytes | None) -> Any:
        assert data is not None
        return fastavro.schemaless_reader(io.BytesIO(data[5:]), self.parsed(schema_id(data)), None)

    def __call__(self, data: bytes | None) -> Any:
        return self.decode(data)


def image(ident: int, record: dict[str, Any]) -> bytes:
    return frame(ident) + avro_body(Schemas().parsed(ident), record)


def change(op: str, key: bytes, after: dict[str, Any] | None = None, before: bytes | None = None) -> dict[str, Any]:
    return {"op": op, "table": "t", "key": key, "before": before, "after": None if after is None else image(5, after)}


@pytest.mark.unit
def test_a_delete_under_another_key_schema_takes_out_the_row_of_its_value_not_of_its_bytes() -> None:
    """numeric(10,2) made numeric(10,3): 1.50 and 0.150 have the same body; the DELETE of 1.50 leaves 0.150."""
    old, new = image(1, {"id": Decimal("1.50")}), image(2, {"id": Decimal("0.150")})
    assert old[5:] == new[5:]
    state = apply_changes([change("INSERT", old, {"id": 1, "v": "a"}), change("INSERT", new, {"id": 2, "v": "b"}),
                           change("DELETE", old)], Schemas())  # type: ignore[arg-type]  # fmt: skip
    assert list(state["t"].values()) == [{"id": 2, "v": "b"}]


@pytest.mark.unit
def test_a_key_widened_from_int_to_long_names_the_same_row_and_a_moved_key_leaves_its_old_one() -> None:
    rows = apply_changes([change("INSERT", image(3, {"id": 1}), {"id": 1, "v": "old"}),
                          change("UPDATE", image(4, {"id": 1}), {"id": 1, "v": "new"}),
                          change("UPDATE", image(4, {"id": 9}), {"id": 9, "v": "moved"}, image(4, {"id": 1}))],
                         Schemas())["t"]  # type: ignore[arg-type]  # fmt: skip
    assert list(rows.values()) == [{"id": 9, "v": "moved"}]


@pytest.mark.unit
def test_a_row_sent_again_under_a_new_scale_is_the_same_row() -> None:
    """1.50 under numeric(10,2) and 1.500 under numeric(10,3): other bytes, the same key."""
    rows = apply_changes([change("INSERT", image(1, {"id": Decimal("1.50")}), {"id": 1, "v": "old"}),
                          change("UPDATE", image(2, {"id": Decimal("1.500")}), {"id": 1, "v": "new"})],
                         Schemas())["t"]  # type: ignore[arg-type]  # fmt: skip
    assert list(rows.values()) == [{"id": 1, "v": "new"}]
