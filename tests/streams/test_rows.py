"""Rows as the endpoint shows them (pure)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal

import pytest

from streams.rows import dumps, pack, to_json, unpack
from tables.wire import lsn_text

pytestmark = pytest.mark.unit


def test_pack_round_trips() -> None:
    assert unpack(pack(0x1_0000_00FF, 7, b"\0row")) == (0x1_0000_00FF, 7, b"\0row")
    assert lsn_text(0x1_0000_00FF) == "1/FF"


def test_values_keep_their_meaning_in_json() -> None:
    row = {
        "price": Decimal("10.50"), "at": datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=2))),
        "local": datetime(2026, 1, 2, 3, 4, 5), "day": date(2026, 1, 2), "clock": time(1, 2, 3),
        "blob": b"\x00\x01", "id": uuid.UUID(int=1), "none": None, "tags": ["a", None], "nan": float("nan"),
        "span": {"months": 1, "days": 2, "microseconds": 3},
    }  # fmt: skip
    assert to_json(row) == {
        "price": "10.50", "at": "2026-01-02T01:04:05.000006Z", "local": "2026-01-02T03:04:05",
        "day": "2026-01-02", "clock": "01:02:03", "blob": "AAE=", "id": "00000000-0000-0000-0000-000000000001",
        "none": None, "tags": ["a", None], "nan": "nan", "span": {"months": 1, "days": 2, "microseconds": 3},
    }  # fmt: skip
    assert to_json(datetime(2026, 1, 1, tzinfo=UTC)) == "2026-01-01T00:00:00Z"


@pytest.mark.parametrize("special", [1.5, float("nan"), float("inf"), -float("inf")])
def test_dumps_writes_what_to_json_and_json_write(special: float) -> None:
    row = {
        "price": Decimal("-0.000100"), "at": datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=-3))),
        "local": datetime(2026, 1, 2, 3, 4, 5), "day": date(2026, 1, 2), "clock": time(1, 2, 3, 4), "blob": b"\xff",
        "id": uuid.UUID(int=2**128 - 1), "none": None, "yes": True, "n": -(2**63), "text": "é\"\n\u2028",
        "items": [{"sku": ("a", 1), "at": date(2000, 1, 1), "f": special}, [], {}], "f": special,
    }  # fmt: skip
    assert dumps(row) == json.dumps(to_json(row), separators=(",", ":")).encode()
    assert dumps(None) == b"null" and dumps([Decimal(1)]) == b'["1"]'
