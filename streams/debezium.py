"""Debezium-format change events, built from raw changes: what Debezium's PostgreSQL connector writes.

Promise: pure (no I/O: registered schema ids and row conversions come from a ``Schemas``
collaborator). ``Debezium.events(change, offset, now_us)`` gives the records one raw change
becomes on ``<prefix>.<schema>.<table>`` (``tables.topics.debezium_topic``), keyed by the
primary key as Debezium keys them: a snapshot read ``r``, an insert ``c``, an update ``u``, a
delete ``d`` followed by a tombstone of its key, an update that changed the key as ``d`` +
tombstone of the old key then ``c`` of the new (with Debezium's ``__debezium.newkey`` /
``__debezium.oldkey`` headers), a TRUNCATE as one ``t`` event without key on partition 0. With
``transactions``, each streamed event carries its ``transaction`` block (id ``xid:commit LSN``,
total and per-table order) and ``<prefix>.transaction`` gets BEGIN before a transaction's first
event and END (event count, per-table counts) after its last; a transaction met in its middle
(a fan-out resumed inside it) is counted from its earlier changes (``earlier``). Values are
Avro in the envelope schema ``envelope_schema`` registers: ``{before, after, source, op, ts_ms,
ts_us, ts_ns, transaction}`` with Debezium's field names and types; row images are forwarded as
the raw topic's bytes (the table's value schema, renamed ``<prefix>.<schema>.<table>.Value``),
never decoded, unless a key must be filled out to a row (``Schemas.from_key``); fastavro writes
the rest after them. Every record
carries ``hw.raw`` (offset and its index among the change's records) so a replay is recognised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import fastavro

from streams.fanout import STREAMED, Change, Output, headers
from tables.partition import partition_for
from tables.topics import debezium_topic, debezium_transaction_topic
from tables.types import avro_name
from tables.wire import FRAME_SIZE, avro_body, frame, schema_id

CONNECTOR = "postgresql"
CODES = {"READ": "r", "INSERT": "c", "UPDATE": "u", "DELETE": "d", "TRUNCATE": "t"}
NEW_KEY, OLD_KEY = "__debezium.newkey", "__debezium.oldkey"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
SNAPSHOT = {"type": "string", "connect.version": 1, "connect.default": "false", "connect.name": "io.debezium.data.Enum",
            "connect.parameters": {"allowed": "true,first,first_in_data_collection,last_in_data_collection,last,"
                                              "false,incremental"}}  # fmt: skip


def _optional(name: str, kind: Any) -> dict[str, Any]:
    return {"name": name, "type": ["null", kind], "default": None}


SOURCE_SCHEMA: dict[str, Any] = {
    "type": "record", "name": "Source", "namespace": "io.debezium.connector.postgresql",
    "fields": [
        {"name": "version", "type": "string"}, {"name": "connector", "type": "string"},
        {"name": "name", "type": "string"}, {"name": "ts_ms", "type": "long"},
        {"name": "snapshot", "type": [SNAPSHOT, "null"], "default": "false"}, {"name": "db", "type": "string"},
        _optional("sequence", "string"), _optional("ts_us", "long"), _optional("ts_ns", "long"),
        {"name": "schema", "type": "string"}, {"name": "table", "type": "string"}, _optional("txId", "long"),
        _optional("lsn", "long"), _optional("xmin", "long"), _optional("origin", "string"),
        _optional("origin_lsn", "long"),
    ],
    "connect.name": "io.debezium.connector.postgresql.Source",
}  # fmt: skip
BLOCK_SCHEMA: dict[str, Any] = {
    "type": "record", "name": "block", "namespace": "event", "connect.version": 1, "connect.name": "event.block",
    "fields": [{"name": "id", "type": "string"}, {"name": "total_order", "type": "long"},
               {"name": "data_collection_order", "type": "long"}],
}  # fmt: skip
COMMON = "io.debezium.connector.common"
TX_KEY_SCHEMA: dict[str, Any] = {
    "type": "record", "name": "TransactionMetadataKey", "namespace": COMMON, "connect.version": 1,
    "connect.name": f"{COMMON}.TransactionMetadataKey", "fields": [{"name": "id", "type": "string"}],
}  # fmt: skip
TX_VALUE_SCHEMA: dict[str, Any] = {
    "type": "record", "name": "TransactionMetadataValue", "namespace": COMMON, "connect.version": 1,
    "connect.name": f"{COMMON}.TransactionMetadataValue",
    "fields": [
        {"name": "status", "type": "string"}, {"name": "id", "type": "string"}, _optional("event_count", "long"),
        _optional("data_collections", {"type": "array", "items": {
            "type": "record", "name": "collection", "namespace": "event", "connect.version": 1,
            "connect.name": "event.collection",
            "fields": [{"name": "data_collection", "type": "string"}, {"name": "event_count", "type": "long"}]}}),
        {"name": "ts_ms", "type": "long"},
    ],
}  # fmt: skip


def namespace(prefix: str, schema: str, table: str) -> str:
    """``<prefix>.<schema>.<table>`` as an Avro namespace (each part made a valid name, as Debezium does)."""
    return ".".join(avro_name(part) for part in [*prefix.split("."), schema, table] if part)


def envelope_schema(prefix: str, schema: str, table: str, value: dict[str, Any]) -> dict[str, Any]:
    """The value schema of a table's Debezium events, around the table's own value schema (renamed ``Value``)."""
    ns = namespace(prefix, schema, table)
    row = {**value, "name": "Value", "namespace": ns, "connect.name": f"{ns}.Value"}
    return {
        "type": "record", "name": "Envelope", "namespace": ns, "connect.version": 2, "connect.name": f"{ns}.Envelope",
        "fields": [
            {"name": "before", "type": ["null", row], "default": None}, _optional("after", f"{ns}.Value"),
            {"name": "source", "type": SOURCE_SCHEMA}, {"name": "op", "type": "string"}, _optional("ts_ms", "long"),
            _optional("ts_us", "long"), _optional("ts_ns", "long"), _optional("transaction", BLOCK_SCHEMA),
        ],
    }  # fmt: skip


def key_schema(prefix: str, schema: str, table: str, key: dict[str, Any]) -> dict[str, Any]:
    """The key schema of a table's Debezium events: the table's key schema, renamed ``Key``."""
    ns = namespace(prefix, schema, table)
    return {**key, "name": "Key", "namespace": ns, "connect.name": f"{ns}.Key"}


# ---- Avro binary: the row images' bytes as they are, the rest written by fastavro ------------
NULL, SOME = b"\x00", b"\x02"  # a union's branch 0 and branch 1: how ``before`` and ``after`` start
TAIL = fastavro.parse_schema({"type": "record", "name": "Tail", "namespace": "headwater.debezium",
                              "fields": envelope_schema("p", "s", "t", {"type": "record", "name": "r",
                                                                        "fields": []})["fields"][2:]})  # fmt: skip
TX_KEY, TX_VALUE = fastavro.parse_schema(TX_KEY_SCHEMA), fastavro.parse_schema(TX_VALUE_SCHEMA)


def micros(instant: Any) -> int:
    """Microseconds since 1970 of a decoded ``timestamp-micros`` (a datetime, or already an int)."""
    return instant if isinstance(instant, int) else (instant - EPOCH) // timedelta(microseconds=1)


class Schemas(Protocol):
    """The registered schema ids and row conversions the events need (``streams.dbzrun`` asks the registry)."""

    def envelope(self, change: Change, value_id: int) -> int:
        """The id of the envelope around value schema ``value_id`` (registered for the change's topic)."""

    def key(self, change: Change, key_id: int) -> int:
        """The id of the Debezium key schema made of the table's key schema ``key_id``."""

    def transaction_ids(self) -> tuple[int, int]:
        """The ids of the transaction topic's key and value schemas."""

    def value_id(self, change: Change) -> int:
        """The id of the table's newest value schema (for an event with no row image)."""

    def from_key(self, key: bytes, value_id: int) -> bytes:
        """A ``Value`` body holding a framed key's columns, the others null or Debezium's fallback (0, '', ...)."""

    def convert(self, row: bytes, value_id: int) -> bytes:
        """A framed row's body in value schema ``value_id``."""


@dataclass
class Transaction:
    """The streamed transaction being written: its id and the events counted so far, per table."""

    lsn: int
    xid: int
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.xid}:{self.lsn}"

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class Event:
    """One Debezium record before framing: key bytes (None: a truncate), value parts, extra headers."""

    key: bytes | None
    value: bytes | None
    extra: list[tuple[str, bytes]] = field(default_factory=list)


class Debezium:
    """Turns raw changes into Debezium-format records (see the module's promise)."""

    def __init__(self, prefix: str, database: str, version: str, partitions: int, schemas: Schemas, *,
                 old_key: Callable[[Change], bytes | None], transactions: bool,
                 earlier: Callable[[Change, int], list[Change]]) -> None:  # fmt: skip
        self.prefix, self.partitions, self.schemas = prefix, partitions, schemas
        self.version, self.database = version, database
        self.old_key, self.transactions, self.earlier = old_key, transactions, earlier
        self.tx: Transaction | None = None
        self.tx_topic = debezium_transaction_topic(prefix)

    def events(self, change: Change, offset: int, now_us: int) -> list[Output]:
        """The records of one (not duplicate) raw change at raw ``offset``, in the order to write them."""
        if change.op not in CODES:
            return []  # the end of the snapshot: no event
        streamed = change.op in STREAMED and change.tx_size > 0  # a snapshot's DELETEs of stale keys: tx_size 0
        tx = self._transaction(change, offset) if self.transactions and streamed else None
        topic = debezium_topic(self.prefix, change.schema, change.table)
        out: list[tuple[str, int, Event]] = []
        if tx is not None and change.position == 0:
            out.append((self.tx_topic, 0, self._boundary(tx, change, "BEGIN")))
        for event in self._events(change, tx, now_us):
            partition = 0 if event.key is None else partition_for(event.key, self.partitions)
            out.append((topic, partition, event))
        if tx is not None and change.position == change.tx_size - 1:
            out.append((self.tx_topic, 0, self._boundary(tx, change, "END")))
        return [Output(t, p, e.key, e.value, headers(change.op, offset, sub, change.commit_lsn, change.position)
                       + e.extra) for sub, (t, p, e) in enumerate(out)]  # fmt: skip

    # ---- the events of one change -------------------------------------------------------------
    def _events(self, change: Change, tx: Transaction | None, now: int) -> list[Event]:
        if change.op == "TRUNCATE":
            return [Event(None, self._value(change, "t", None, None, tx, now))]
        key = None if change.key is None else self._key(change, change.key)  # a table without key: no key
        if change.op in ("READ", "INSERT"):
            return [Event(key, self._value(change, CODES[change.op], None, change.after, tx, now))]
        old = self.old_key(change) if change.op == "UPDATE" else None
        before = self._before(change)
        if change.op == "UPDATE" and old is None:
            return [Event(key, self._value(change, "u", before, change.after, tx, now))]
        gone = key if old is None else self._key(change, old)
        deleted = Event(gone, self._value(change, "d", before, None, tx, now))
        if old is None:
            return [deleted] if gone is None else [deleted, Event(gone, None)]  # a delete, then its tombstone
        assert key is not None and gone is not None
        deleted.extra = [(NEW_KEY, key)]
        created = Event(key, self._value(change, "c", None, change.after, tx, now), [(OLD_KEY, gone)])
        return [deleted, Event(gone, None), created]

    def _key(self, change: Change, key: bytes) -> bytes:
        return frame(self.schemas.key(change, schema_id(key))) + key[FRAME_SIZE:]

    def _before(self, change: Change) -> bytes | None:
        """The old row as a framed ``Value``: the full old row (REPLICA IDENTITY FULL), else the old key (an
        update's, or a delete's own) filled out; None for an update PostgreSQL sent no old values for."""
        old = change.before if change.before is not None or change.op != "DELETE" else change.key
        if old is None or change.key is None:
            return old
        if old[:FRAME_SIZE] != change.key[:FRAME_SIZE]:
            return old  # a full row
        value_id = schema_id(change.after) if change.after is not None else self.schemas.value_id(change)
        return frame(value_id) + self.schemas.from_key(old, value_id)

    def _value(self, change: Change, code: str, before: bytes | None, after: bytes | None, tx: Transaction | None,
               now: int) -> bytes:  # fmt: skip
        image = after or before
        value_id = schema_id(image) if image else self.schemas.value_id(change)
        tail = {"source": self._source(change), "op": code, "ts_ms": now // 1000, "ts_us": now, "ts_ns": now * 1000,
                "transaction": None if tx is None else self._block(tx, change)}  # fmt: skip
        return b"".join((frame(self.schemas.envelope(change, value_id)), self._image(before, value_id),
                         self._image(after, value_id), avro_body(TAIL, tail)))  # fmt: skip

    def _image(self, row: bytes | None, value_id: int) -> bytes:
        if row is None:
            return NULL
        if schema_id(row) != value_id:  # images of two schema versions in one event: the rare path
            return SOME + self.schemas.convert(row, value_id)
        return SOME + row[FRAME_SIZE:]

    def _source(self, change: Change) -> dict[str, Any]:
        at = micros(change.commit_time)
        return {"version": self.version, "connector": CONNECTOR, "name": self.prefix, "ts_ms": at // 1000,
                "snapshot": snapshot_flag(change), "db": self.database, "sequence": None,
                "ts_us": at, "ts_ns": at * 1000, "schema": change.schema, "table": change.table, "txId": change.xid,
                "lsn": change.commit_lsn, "xmin": None, "origin": None, "origin_lsn": None}  # fmt: skip

    # ---- transactions -----------------------------------------------------------------------------
    def _transaction(self, change: Change, offset: int) -> Transaction:
        """The change's transaction, its earlier events counted (read back when it is met in its middle)."""
        tx = self.tx
        if tx is None or (tx.lsn, tx.xid) != (change.commit_lsn, change.xid):
            tx = self.tx = Transaction(change.commit_lsn, change.xid)
            for earlier in self.earlier(change, offset) if change.position > 0 else []:
                table = f"{earlier.schema}.{earlier.table}"
                key_changed = earlier.op == "UPDATE" and self.old_key(earlier) is not None
                tx.counts[table] = tx.counts.get(table, 0) + (2 if key_changed else 1)  # a key change: d and c
        return tx

    def _block(self, tx: Transaction, change: Change) -> dict[str, Any]:
        """The ``transaction`` block of one more event of ``change``'s table: id, total and per-table order."""
        table = f"{change.schema}.{change.table}"
        tx.counts[table] = tx.counts.get(table, 0) + 1
        return {"id": tx.name, "total_order": tx.total, "data_collection_order": tx.counts[table]}

    def _boundary(self, tx: Transaction, change: Change, status: str) -> Event:
        """A BEGIN or END record of the transaction topic (END: the event count, per table)."""
        key_id, value_id = self.schemas.transaction_ids()
        end = status == "END"
        counts = [{"data_collection": t, "event_count": n} for t, n in tx.counts.items()] if end else None
        value = {"status": status, "id": tx.name, "event_count": tx.total if end else None, "data_collections": counts,
                 "ts_ms": micros(change.commit_time) // 1000}  # fmt: skip
        return Event(frame(key_id) + avro_body(TX_KEY, {"id": tx.name}), frame(value_id) + avro_body(TX_VALUE, value))


def snapshot_flag(change: Change) -> str:
    """``source.snapshot`` as Debezium sets it: ``incremental`` for a backfill's rows (its incremental
    snapshots), ``true`` for the initial snapshot's, ``false`` for streamed changes."""
    if change.op != "READ":
        return "false"
    return "true" if change.backfill is None else "incremental"
