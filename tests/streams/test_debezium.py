"""Debezium-format events from raw changes, field by field against Debezium's documented examples (pure).

The examples are the PostgreSQL connector's documentation (debezium/debezium,
documentation/modules/ROOT/pages/connectors/postgresql.adoc: the ``customers`` table's create,
update, delete and truncate events, the tombstone after a delete, primary key updates, and
transaction metadata) and its source schema (``PostgresSourceInfoStructMaker``, ``SchemaFactory``).
The hand-built Avro is decoded with fastavro against the schemas the events are registered with.
"""

from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any, cast

import fastavro
import pytest

from streams.config import load_streams_config
from streams.dbzrun import DebeziumRun, fallback
from streams.debezium import (
    NEW_KEY,
    OLD_KEY,
    TX_KEY_SCHEMA,
    TX_VALUE_SCHEMA,
    Debezium,
    envelope_schema,
    key_schema,
    micros,
)
from streams.fanout import Change, FanOut, Output
from tables.partition import partition_for
from tables.wire import HEADER_RAW, avro_body, body, frame, schema_id

pytestmark = pytest.mark.unit

PREFIX = "PostgreSQL_server"
VALUE = {"type": "record", "name": "customers", "namespace": "headwater.public", "pg.table": "public.customers",
         "fields": [{"name": "id", "type": "int"}, {"name": "first_name", "type": "string"},
                    {"name": "last_name", "type": "string"}, {"name": "email", "type": "string"},
                    {"name": "since", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}],
                     "default": None}]}  # fmt: skip
KEY = {"type": "record", "name": "customers_key", "namespace": "headwater.public",
       "fields": [{"name": "id", "type": "int"}]}  # fmt: skip
ANNE = {"id": 1, "first_name": "Anne", "last_name": "Kretchmar", "email": "annek@noanswer.org", "since": None}
COMMITTED = datetime(2019, 5, 28, 8, 58, 24, 863123, tzinfo=UTC)  # the documentation's source.ts_us
NOW = 1559033904863841  # the documentation's ts_us


class Schemas:
    """The registry ids the events need, kept in memory (the real ones: ``streams.dbzrun.RegistrySchemas``)."""

    def __init__(self) -> None:
        self.by_id: dict[int, dict[str, Any]] = {1: VALUE, 2: KEY}
        self.ids: dict[str, int] = {}

    def _register(self, subject: str, schema: dict[str, Any]) -> int:
        if subject not in self.ids:
            self.ids[subject] = len(self.by_id) + 1
            self.by_id[self.ids[subject]] = schema
        return self.ids[subject]

    def envelope(self, change: Change, value_id: int) -> int:
        return self._register("value", envelope_schema(PREFIX, change.schema, change.table, self.by_id[value_id]))

    def key(self, change: Change, key_id: int) -> int:
        return self._register("key", key_schema(PREFIX, change.schema, change.table, self.by_id[key_id]))

    def transaction_ids(self) -> tuple[int, int]:
        return self._register("tx-key", TX_KEY_SCHEMA), self._register("tx-value", TX_VALUE_SCHEMA)

    def value_id(self, change: Change) -> int:
        return 1

    def from_key(self, key: bytes, value_id: int) -> bytes:
        columns = self.decode(key)
        fields = self.by_id[value_id]["fields"]
        return avro_body(fastavro.parse_schema(self.by_id[value_id]),
                         {f["name"]: columns.get(f["name"], fallback(f["type"])) for f in fields})  # fmt: skip

    def convert(self, row: bytes, value_id: int) -> bytes:
        raise AssertionError("one schema version here")

    def decode(self, data: bytes | None) -> Any:
        if data is None:
            return None
        parsed = fastavro.parse_schema(self.by_id[schema_id(data)])
        return fastavro.schemaless_reader(io.BytesIO(body(data)), parsed, None)


def row(**changes: Any) -> bytes:
    return frame(1) + avro_body(fastavro.parse_schema(VALUE), {**ANNE, **changes})


def key(n: int = 1) -> bytes:
    return frame(2) + avro_body(fastavro.parse_schema(KEY), {"id": n})


def change(op: str, *, before: bytes | None = None, after: bytes | None = None, k: int = 1, position: int = 0,
           size: int = 1, table: str = "customers", lsn: int = 24023128) -> Change:  # fmt: skip
    return Change(op, "public", table, f"p.{table}", lsn, position, key(k), before, after, size, 555, COMMITTED)


def debezium(schemas: Schemas, *, transactions: bool = False, earlier: list[Change] | None = None) -> Debezium:
    def old_key(c: Change) -> bytes | None:
        return c.before if c.before is not None and c.before[:5] == c.key[:5] and c.before != c.key else None  # type: ignore[index]

    return Debezium(PREFIX, "postgres", "headwater-test", 3, schemas, old_key=old_key, transactions=transactions,
                    earlier=lambda c, offset: list(earlier or []))  # fmt: skip


def decoded(schemas: Schemas, out: Output) -> tuple[Any, Any, dict[str, bytes]]:
    return schemas.decode(out.key), schemas.decode(out.value), dict(out.headers)


def test_a_create_event_is_the_documented_one_field_by_field() -> None:
    schemas = Schemas()
    [out] = debezium(schemas).events(change("INSERT", after=row()), offset=7, now_us=NOW)
    k, value, headers = decoded(schemas, out)
    assert k == {"id": 1} and out.topic == f"{PREFIX}.public.customers" and headers[HEADER_RAW] == b"7.0"
    assert value == {
        "before": None,
        "after": ANNE,
        "source": {"version": "headwater-test", "connector": "postgresql", "name": PREFIX, "ts_ms": 1559033904863,
                   "ts_us": 1559033904863123, "ts_ns": 1559033904863123000, "snapshot": "false", "db": "postgres",
                   "sequence": None, "schema": "public", "table": "customers", "txId": 555, "lsn": 24023128,
                   "xmin": None, "origin": None, "origin_lsn": None},
        "op": "c", "ts_ms": 1559033904863, "ts_us": 1559033904863841, "ts_ns": 1559033904863841000,
        "transaction": None,
    }  # fmt: skip
    envelope = schemas.by_id[schema_id(out.value)]  # type: ignore[arg-type]
    assert envelope["name"] == "Envelope" and envelope["namespace"] == f"{PREFIX}.public.customers"
    assert [f["name"] for f in envelope["fields"]] == ["before", "after", "source", "op", "ts_ms", "ts_us", "ts_ns",
                                                       "transaction"]  # fmt: skip
    documented = {"version", "connector", "name", "ts_ms", "ts_us", "ts_ns", "snapshot", "db", "schema", "table",
                  "txId", "lsn", "xmin"}  # fmt: skip
    ours = {f["name"] for f in envelope["fields"][2]["type"]["fields"]}
    assert documented <= ours and ours - documented == {"sequence", "origin", "origin_lsn"}  # the code has these too
    assert envelope["fields"][0]["type"][1]["name"] == "Value" and schemas.by_id[schema_id(out.key)]["name"] == "Key"  # type: ignore[arg-type]
    assert partition_of(out) == out.partition


def partition_of(out: Output) -> int:
    assert out.key is not None
    return partition_for(out.key, 3)  # murmur2 of the Debezium key's bytes, as a JVM producer picks


def test_update_delete_and_tombstone_with_replica_identity_default_and_full() -> None:
    schemas = Schemas()
    dbz = debezium(schemas)
    [update] = dbz.events(change("UPDATE", after=row(first_name="Anne Marie")), 8, NOW)
    value = schemas.decode(update.value)
    assert (value["op"], value["before"], value["after"]["first_name"]) == ("u", None, "Anne Marie")  # DEFAULT
    [full] = dbz.events(change("UPDATE", before=row(), after=row(first_name="Anne Marie")), 9, NOW)
    assert schemas.decode(full.value)["before"] == ANNE  # REPLICA IDENTITY FULL: the old row

    deleted, tombstone = dbz.events(change("DELETE"), 10, NOW)  # DEFAULT: the raw change carries the key only
    value = schemas.decode(deleted.value)
    assert (value["op"], value["after"]) == ("d", None)
    # DEFAULT: the key's columns; Debezium fills NOT NULL columns it was not sent with their fallback, others null
    assert value["before"] == {"id": 1, "first_name": "", "last_name": "", "email": "", "since": None}
    assert tombstone.key == deleted.key and tombstone.value is None and tombstone.partition == deleted.partition
    assert [dict(o.headers)[HEADER_RAW] for o in (deleted, tombstone)] == [b"10.0", b"10.1"]
    deleted_full, _ = dbz.events(change("DELETE", before=row()), 11, NOW)
    assert schemas.decode(deleted_full.value)["before"] == ANNE


def test_a_primary_key_update_is_a_delete_a_tombstone_and_a_create_with_the_key_headers() -> None:
    schemas = Schemas()
    deleted, tombstone, created = debezium(schemas).events(change("UPDATE", before=key(1), after=row(id=2), k=2),
                                                           12, NOW)  # fmt: skip
    assert schemas.decode(deleted.key) == {"id": 1} and schemas.decode(created.key) == {"id": 2}
    assert schemas.decode(deleted.value)["op"] == "d" and schemas.decode(created.value)["op"] == "c"
    assert (tombstone.key, tombstone.value) == (deleted.key, None)
    assert dict(deleted.headers)[NEW_KEY] == created.key and dict(created.headers)[OLD_KEY] == deleted.key
    assert schemas.decode(created.value)["after"] == {**ANNE, "id": 2}


def test_truncate_and_snapshot_read_events() -> None:
    schemas = Schemas()
    dbz = debezium(schemas)
    [truncated] = dbz.events(Change("TRUNCATE", "public", "customers", "p.customers", 46523128, 0, None, None, None,
                                    1, 556, COMMITTED), 13, NOW)  # fmt: skip
    value = schemas.decode(truncated.value)
    assert (truncated.key, truncated.partition) == (None, 0)  # no key, as Debezium
    assert (value["op"], value["before"], value["after"], value["source"]["lsn"]) == ("t", None, None, 46523128)
    [read] = dbz.events(change("READ", after=row()), 14, NOW)
    assert schemas.decode(read.value)["op"] == "r" and schemas.decode(read.value)["source"]["snapshot"] == "true"
    [backfilled] = dbz.events(change("READ", after=row())._replace(backfill=3, tx_size=1), 14, NOW)
    assert schemas.decode(backfilled.value)["source"]["snapshot"] == "incremental"  # as Debezium's incremental reads
    assert dbz.events(Change("SNAPSHOT_END", "", "", "", 1, 0, None, None, None), 15, NOW) == []
    stale = debezium(schemas, transactions=True).events(change("DELETE", size=0), 16, NOW)  # a snapshot's clean-up
    assert [o.topic for o in stale] == [f"{PREFIX}.public.customers"] * 2  # no BEGIN without an END


def test_transaction_metadata_begin_blocks_end_with_counts_per_table_as_documented() -> None:
    schemas = Schemas()
    dbz = debezium(schemas, transactions=True)
    out = dbz.events(change("INSERT", after=row(), position=0, size=3, lsn=53195832), 20, NOW)
    out += dbz.events(change("UPDATE", after=row(), position=1, size=3, lsn=53195832), 21, NOW)
    out += dbz.events(change("INSERT", after=row(), position=2, size=3, lsn=53195832, table="orders"), 22, NOW)
    begin, first, second, third, end = out
    assert begin.topic == end.topic == f"{PREFIX}.transaction" and begin.partition == end.partition == 0
    assert schemas.decode(begin.key) == {"id": "555:53195832"} == schemas.decode(end.key)
    assert schemas.decode(begin.value) == {"status": "BEGIN", "id": "555:53195832", "event_count": None,
                                           "data_collections": None, "ts_ms": 1559033904863}  # fmt: skip
    assert schemas.decode(end.value) == {
        "status": "END", "id": "555:53195832", "event_count": 3, "ts_ms": 1559033904863,
        "data_collections": [{"data_collection": "public.customers", "event_count": 2},
                             {"data_collection": "public.orders", "event_count": 1}],
    }  # fmt: skip
    blocks = [schemas.decode(o.value)["transaction"] for o in (first, second, third)]
    assert blocks == [{"id": "555:53195832", "total_order": 1, "data_collection_order": 1},
                      {"id": "555:53195832", "total_order": 2, "data_collection_order": 2},
                      {"id": "555:53195832", "total_order": 3, "data_collection_order": 1}]  # fmt: skip
    assert [dict(o.headers)[HEADER_RAW] for o in out] == [b"20.0", b"20.1", b"21.0", b"22.0", b"22.1"]


def test_a_transaction_met_in_its_middle_counts_its_earlier_changes() -> None:
    schemas = Schemas()
    earlier = [change("INSERT", after=row(), position=0, size=3), change("UPDATE", before=key(1), after=row(id=2),
                                                                         k=2, position=1, size=3)]  # fmt: skip
    dbz = debezium(schemas, transactions=True, earlier=earlier)
    created, end = dbz.events(change("INSERT", after=row(), position=2, size=3, k=3), 30, NOW)
    assert schemas.decode(created.value)["transaction"]["total_order"] == 4  # c, then d + c of the key change
    assert schemas.decode(end.value)["event_count"] == 4


def test_decoded_instants_in_microseconds() -> None:
    assert micros(COMMITTED) == 1559033904863123 and micros(5) == 5


def test_the_debezium_topics_a_checkpoint_names_are_its_table_topics_only() -> None:
    cfg = load_streams_config({"HEADWATER_STREAMS_TOPIC_PREFIX": "p", "HEADWATER_STREAMS_DEBEZIUM": "true",
                               "HEADWATER_STREAMS_DEBEZIUM_DATABASE": "shop"})  # fmt: skip
    run = DebeziumRun(cfg, cast(Any, None), cast(Any, None), lambda change: None, cast(Any, None))
    verified = {(t, 0): 1 for t in ["p.debezium.public.orders", "p.debezium.transaction", "p.debezium.x",
                                    "p.orders", "p.changes.dlq", "p.debezium.public.items", "p.debezium.a.b"]}
    assert run.kept(verified, served={"p.orders", "p.debezium.a.b"}) == ["p.debezium.public.items",
                                                                         "p.debezium.public.orders"]  # fmt: skip


@pytest.mark.unit
def test_the_tails_read_at_a_first_write_hold_the_fan_outs_mends_until_the_raw_topic_is_read_past_them() -> None:
    cfg = load_streams_config({"HEADWATER_STREAMS_TOPIC_PREFIX": "p", "HEADWATER_STREAMS_DEBEZIUM": "true",
                               "HEADWATER_STREAMS_DEBEZIUM_DATABASE": "shop"})  # fmt: skip

    class Writer:  # where a crashed run's records end, as ``TableWriter.tails`` reads them from Kafka
        def ensure_topics(self, topics: list[str], **_: Any) -> list[str]:
            return topics

        def tails(self, topics: list[str]) -> dict[tuple[str, int], tuple[int, int]]:
            return {(topics[0], 0): (40, 0), (topics[0], 1): (57, 2)}

    run = DebeziumRun(cfg, cast(Any, None), cast(Any, Writer()), lambda change: None, cast(Any, None))
    fan = FanOut(cfg.partitions, (-1, -1), {}, cast(Any, None))
    run._load(fan, "p.debezium.public.orders")
    assert run.ready == 58 and fan.tails[("p.debezium.public.orders", 1)] == (57, 2)
    run.reset([])
    assert run.ready == 0
