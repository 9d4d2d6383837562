"""What the Debezium-format topics cost the fan-out, per change, in one process (no broker needed).

Raw change records of the sample shop's ``orders`` (insert, update, delete in 5:4:1, one
change per transaction) are made once, Avro in the raw topic's schema. Then, timed apart:

1. the fan-out's own work per change with ``[streams] debezium`` off: decode the raw record
   (fastavro, as ``streams.fanrun.decode``), ``Change.from_record``, ``FanOut.route``;
2. the same plus the Debezium records of each change (``streams.debezium.Debezium.events``,
   transaction metadata on), schema ids already registered (as after a worker's first batch).

Producing is left out: Debezium adds one record per insert and update and two per delete (the
event and its tombstone), plus BEGIN and END per transaction, which librdkafka sends as it sends
the table records. The best of ``rounds`` runs is shown.
"""

from __future__ import annotations

import io
import random
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, cast

import fastavro

from bench.analytics import KEY, ORDER, STATUSES
from streams.dbzrun import fallback
from streams.debezium import TX_KEY_SCHEMA, TX_VALUE_SCHEMA, Debezium, envelope_schema, key_schema
from streams.fanout import Change, FanOut
from tables.change import CHANGE_VALUE_SCHEMA
from tables.wire import avro_body, body, frame, schema_id

RAW = fastavro.parse_schema(CHANGE_VALUE_SCHEMA)


class MemorySchemas:
    """Schema ids as a worker holds them once registered (the real ones ask the registry once per version)."""

    def __init__(self) -> None:
        self.by_id: dict[int, Any] = {1: ORDER, 2: KEY}
        self.ids: dict[str, int] = {}

        self.parsed = {1: fastavro.parse_schema(ORDER), 2: fastavro.parse_schema(KEY)}

    def _id(self, name: str, schema: Any) -> int:
        if name not in self.ids:
            self.ids[name] = len(self.by_id) + 1
            self.by_id[self.ids[name]] = schema()
        return self.ids[name]

    def envelope(self, change: Change, value_id: int) -> int:
        return self._id("value", lambda: envelope_schema("bench.debezium", change.schema, change.table, ORDER))

    def key(self, change: Change, key_id: int) -> int:
        return self._id("key", lambda: key_schema("bench.debezium", change.schema, change.table, KEY))

    def transaction_ids(self) -> tuple[int, int]:
        return self._id("tx-key", lambda: TX_KEY_SCHEMA), self._id("tx-value", lambda: TX_VALUE_SCHEMA)

    def value_id(self, change: Change) -> int:
        return 1

    def from_key(self, key: bytes, value_id: int) -> bytes:
        columns = cast(dict[str, Any], fastavro.schemaless_reader(io.BytesIO(body(key)), self.parsed[2], None))
        return avro_body(self.parsed[1],
                         {f["name"]: columns.get(f["name"], fallback(f["type"])) for f in ORDER["fields"]})  # fmt: skip

    def convert(self, row: bytes, value_id: int) -> bytes:
        raise AssertionError("one schema version here")


def raw_records(count: int) -> list[bytes]:
    """Framed raw change records of ``orders``: insert, update, delete in 5:4:1."""
    rng, epoch = random.Random(3), datetime(2026, 1, 1, tzinfo=UTC)
    value, key = fastavro.parse_schema(ORDER), fastavro.parse_schema(KEY)
    out = []
    for n in range(count):
        op = ("INSERT",) * 5 + ("UPDATE",) * 4 + ("DELETE",)
        kind = op[n % 10]
        order = {"id": n, "customer_id": rng.randint(1, 5000), "status": rng.choice(STATUSES),
                 "total": Decimal(rng.randint(0, 10**8)) / 100, "placed_at": epoch + timedelta(seconds=n),
                 "note": None if n % 3 else f"note {n}"}  # fmt: skip
        record = {"op": kind, "schema": "public", "table": "orders", "topic": "bench.orders", "commit_lsn": 1000 + n,
                  "xid": 700 + n, "commit_time": epoch + timedelta(seconds=n), "position": 0, "tx_size": 1,
                  "key": frame(2) + avro_body(key, {"id": n}), "before": None,
                  "after": None if kind == "DELETE" else frame(1) + avro_body(value, order)}  # fmt: skip
        out.append(frame(9) + avro_body(RAW, record))
    return out


def fan_out(records: list[bytes], debezium: Debezium | None) -> float:
    """Seconds to decode and route every record (and build its Debezium records when given one)."""
    fan = FanOut(partitions=4)
    started = time.perf_counter()
    for offset, data in enumerate(records):
        schema_id(data)
        change = Change.from_record(cast(dict[str, Any], fastavro.schemaless_reader(io.BytesIO(body(data)), RAW, None)))
        fresh = debezium is not None and not fan.duplicate(change)
        fan.route(change, offset)
        if fresh:
            debezium.events(change, offset, 1_700_000_000_000_000)  # type: ignore[union-attr]
    return time.perf_counter() - started


def main(changes: int, rounds: int = 3) -> None:
    records = raw_records(changes)
    fan = FanOut(partitions=4)
    print(f"\nfan-out work per change, {changes} orders changes (insert:update:delete 5:4:1, one per transaction),"
          f" best of {rounds}")  # fmt: skip
    off = min(fan_out(records, None) for _ in range(rounds))
    print(f"  debezium off (decode, route):         {off:6.2f} s  {changes / off:9.0f} changes/s"
          f"  {off / changes * 1e6:6.1f} us/change")  # fmt: skip
    for transactions in (False, True):
        dbz = Debezium("bench.debezium", "shop", "headwater-bench", 4, MemorySchemas(), old_key=fan.old_key,
                       transactions=transactions, earlier=lambda change, offset: [])  # fmt: skip
        on = min(fan_out(records, dbz) for _ in range(rounds))
        what = "+ envelope, BEGIN/END" if transactions else "+ envelope, tombstones"
        print(f"  debezium on ({what}): {on:6.2f} s  {changes / on:9.0f} changes/s  {on / changes * 1e6:6.1f} us/change"
              f"  (+{(on - off) / changes * 1e6:.1f} us, +{on / off - 1:.0%})")  # fmt: skip
    print("  producing the extra records is not counted")
