"""The Debezium-format topics' runtime, beside the fan-out: schemas registered, topics made, replays skipped.

Promise: with ``[streams] debezium`` on, ``DebeziumRun.emit`` writes the records of each raw change
the fan-out routes (``streams.debezium``) to ``<debezium prefix>.<schema>.<table>`` — compacted,
with the table topics' partition count, made on first use — and with ``debezium_transactions`` the
BEGIN/END records to ``<debezium prefix>.transaction`` (one partition, not compacted). They are
written with the fan-out's batch, so its checkpoint covers them; a record a crashed run already
wrote is recognised by the partition's last record (tails read when a run first writes to a topic,
or at its start for those the checkpoint names: ``kept``; ``ready`` is the raw offset past the
first) and not written twice; ``again`` builds the same records of replayed changes, so a key
another writer's record left behind gets its newest written again, as on the table topics.
``RegistrySchemas`` registers each envelope and key schema once per table schema version, under
``<topic>-value`` / ``<topic>-key``, and fills a key out to a row for deletes under REPLICA IDENTITY
DEFAULT. A transaction met in its middle is recounted from the raw topic. Its collaborators
(settings, registry, writer, raw decoder) are passed in.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Collection
from contextlib import closing
from decimal import Decimal
from importlib import metadata
from typing import Any

import fastavro

from streams import clients
from streams.config import StreamsConfig
from streams.debezium import TX_KEY_SCHEMA, TX_VALUE_SCHEMA, Debezium, envelope_schema, key_schema
from streams.fanout import Change, FanOut
from streams.writer import Pending, TableWriter
from tables.errors import FatalError
from tables.kafka import read_on
from tables.registry import Registry
from tables.topics import debezium_topic, debezium_transaction_topic, key_subject, value_subject
from tables.wire import avro_body, body, schema_id

log = logging.getLogger("headwater.streams")


def version() -> str:
    """``source.version``: Headwater's, so a reader can tell these events from Debezium's own."""
    try:
        return f"headwater-{metadata.version('headwater')}"
    except metadata.PackageNotFoundError:
        return "headwater"


class DebeziumRun:
    """Writes the Debezium-format records of the raw changes the fan-out handles."""

    def __init__(self, cfg: StreamsConfig, registry: Registry, writer: TableWriter, old_key: Callable[[Change], Any],
                 decode: Callable[[bytes | None], Change]) -> None:  # fmt: skip
        if not cfg.debezium_database:
            raise FatalError("[streams] debezium is on but debezium_database is not set",
                             hint="set [streams] debezium_database to the captured database's name (source.db)")
        self.cfg, self.writer, self.decode, self.registry = cfg, writer, decode, registry
        self.schemas = RegistrySchemas(registry, cfg.dbz_prefix)
        self.old_key = old_key
        self.builder = self.again()
        self.loaded: set[str] = set()  # topics whose tails this run has read
        self.ready = 0  # raw offset past the tails read at a first write: the fan-out's mends wait until it is read
        self.written = 0

    def again(self) -> Debezium:
        """A builder of its own (no transaction under way): the records of changes replayed from the raw topic, the
        same as they were first written (a rewrite of a key's newest, ``streams.fanrun``)."""
        cfg = self.cfg
        return Debezium(cfg.dbz_prefix, cfg.debezium_database, version(), cfg.partitions, self.schemas,
                        old_key=self.old_key, transactions=cfg.debezium_transactions, earlier=self.earlier)

    def owns(self, topic: str) -> bool:
        """Whether ``topic`` is one of the Debezium-format table topics this run writes (a key's newest is kept)."""
        return topic in self.loaded and topic != debezium_transaction_topic(self.cfg.dbz_prefix)

    def kept(self, verified: dict[tuple[str, int], int], served: Collection[str]) -> list[str]:
        """The Debezium-format table topics (``<prefix>.<schema>.<table>``) a checkpoint says were examined, none of
        the fan-out's others: it reads their tails at its start, with the table topics, so the next owner examines
        what the last one wrote past them."""
        cfg = self.cfg
        others = {*served, cfg.dlq_topic, cfg.changes_topic, debezium_transaction_topic(cfg.dbz_prefix)}
        prefix = f"{cfg.dbz_prefix}."
        return sorted({topic for topic, _ in verified if topic.startswith(prefix) and "." in topic[len(prefix):]
                       and topic not in others})  # fmt: skip

    def reset(self, loaded: list[str]) -> None:
        """The fan-out reloaded its state (a new ``FanOut``, the tails of ``loaded`` read with it): read the other
        topics' tails again before writing."""
        self.loaded = set(loaded)
        self.ready = 0
        self.builder.tx = None

    def emit(self, fan: FanOut, change: Change, offset: int, pending: Pending) -> None:
        outputs = self.builder.events(change, offset, time.time_ns() // 1000)
        fresh = []
        for sub, out in enumerate(outputs):
            if out.topic not in self.loaded:
                self._load(fan, out.topic)
            if fan.fresh(out.topic, out.partition, (offset, sub)):
                fresh.append(out)
        self.writer.write(fresh, pending)
        self.written += len(fresh)

    def _load(self, fan: FanOut, topic: str) -> None:
        if topic == debezium_transaction_topic(self.cfg.dbz_prefix):
            self.writer.ensure_topics([topic], partitions=1, compact=False)
        else:
            self.writer.ensure_topics([topic])
        tails = self.writer.tails([topic])
        fan.tails.update(tails)
        self.ready = max(self.ready, 1 + max((at[0] for at in tails.values()), default=-1))
        self.loaded.add(topic)

    def earlier(self, change: Change, offset: int) -> list[Change]:
        """The changes of ``change``'s transaction before it, read back from the raw topic (duplicates once)."""
        log.info("Debezium topics: counting transaction %d:%d from raw offset %d (met at its change %d)",
                 change.xid, change.commit_lsn, offset - change.position, change.position)  # fmt: skip
        found: dict[int, Change] = {}
        start = {(self.cfg.changes_topic, 0): max(offset - change.position, 0)}
        with closing(read_on(clients.reader_settings(self.cfg), start, timeout=60)) as reading:
            for msg in reading:  # closed when left: its consumer now, not when the generator is collected
                if int(msg.offset() or 0) >= offset:
                    break
                seen = self.decode(msg.value())
                if (seen.commit_lsn, seen.xid) == (change.commit_lsn, change.xid) and seen.position < change.position:
                    found[seen.position] = seen
        return [found[p] for p in sorted(found)]


class RegistrySchemas:
    """The schema ids of the Debezium records, registered once per table schema version."""

    def __init__(self, registry: Registry, prefix: str) -> None:
        self.registry, self.prefix = registry, prefix
        self.ids: dict[tuple[str, int], int] = {}  # (subject, table schema id) -> registered id
        self.newest: dict[str, int] = {}
        self.tx: tuple[int, int] | None = None

    def _subject(self, change: Change, kind: str) -> str:
        topic = debezium_topic(self.prefix, change.schema, change.table)
        return key_subject(topic) if kind == "key" else value_subject(topic)

    def _registered(self, change: Change, kind: str, table_id: int) -> int:
        subject = self._subject(change, kind)
        found = self.ids.get((subject, table_id))
        if found is None:
            make = envelope_schema if kind == "value" else key_schema
            schema = make(self.prefix, change.schema, change.table, self.registry.schema(table_id))
            found = self.ids[(subject, table_id)] = self.registry.register(subject, schema,
                                                                            table=f"{change.schema}.{change.table}")
        return found

    def envelope(self, change: Change, value_id: int) -> int:
        return self._registered(change, "value", value_id)

    def key(self, change: Change, key_id: int) -> int:
        return self._registered(change, "key", key_id)

    def transaction_ids(self) -> tuple[int, int]:
        if self.tx is None:
            topic = debezium_transaction_topic(self.prefix)
            self.tx = (self.registry.register(key_subject(topic), TX_KEY_SCHEMA),
                       self.registry.register(value_subject(topic), TX_VALUE_SCHEMA))  # fmt: skip
        return self.tx

    def value_id(self, change: Change) -> int:
        found = self.newest.get(change.topic)
        if found is None:
            latest = self.registry.latest(value_subject(change.topic))
            if latest is None:
                raise FatalError(f"no value schema is registered for {change.topic}",
                                 hint="capture registers it with the table's first change: run capture")
            found = self.newest[change.topic] = latest[0]
        return found

    def from_key(self, key: bytes, value_id: int) -> bytes:
        columns = self.registry.decode(key)
        schema = self.registry.schema(value_id)
        row = {f["name"]: columns[f["name"]] if f["name"] in columns else fallback(f["type"]) for f in schema["fields"]}
        return avro_body(self.registry.parsed(value_id), row)

    def convert(self, row: bytes, value_id: int) -> bytes:
        writer, wanted = self.registry.parsed(schema_id(row)), self.registry.parsed(value_id)
        return avro_body(wanted, fastavro.schemaless_reader(io.BytesIO(body(row)), writer, wanted))


def fallback(kind: Any) -> Any:
    """What Debezium puts in a column its event does not carry: null if it may be null, else 0, '', false, ..."""
    if isinstance(kind, list):
        return None if "null" in kind else fallback(kind[0])
    if isinstance(kind, dict):
        logical, base = kind.get("logicalType"), kind["type"]
        if logical == "decimal":
            return Decimal(0)
        if base == "record":
            return {f["name"]: fallback(f["type"]) for f in kind["fields"]}
        if base == "enum":
            return kind["symbols"][0]
        if base == "fixed":
            return b"\0" * int(kind["size"])
        return {"array": [], "map": {}}.get(base, fallback(base))
    return {"string": "", "bytes": b"", "boolean": False, "int": 0, "long": 0, "float": 0.0, "double": 0.0}.get(kind)

