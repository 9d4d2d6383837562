"""The views' runtime: raw changes in commit order in, view rows and published cuts out.

Promise: ``Materializer.handle`` applies a batch of raw changes to the join state (a
one-partition, changelog-backed Faust table), in order, dropping changes capture sent
twice (the ``(commit_lsn, position)`` watermark of streamed changes). At the last
*consistent point* of the batch — the end of a transaction or of the snapshot — it
builds every dirty view row, writes those that changed to the view topics (compacted,
Avro, keyed by the base row's key, every row carrying that commit LSN), waits until
Kafka acknowledged them, then publishes a *cut* per view on ``<prefix>.views.cuts``:
the commit LSN and each view-topic partition's end, so a reader who reads the view
topic to those ends sees every transaction up to the LSN whole and none after it.
Only then are the dirty marks cleared and the progress saved.

After a crash the state holds a prefix of what was written (one partition keeps order);
replay starts at the saved progress, re-applies changes (idempotent), and publishes
nothing until it is past the last raw offset whose writes the state may hold
(``@high``, written before each batch), so no half-replayed state is ever published.
A view row that did not change is not written again: a replay adds nothing to the
view topics' latest state.
"""

from __future__ import annotations

import asyncio
import io
import logging
import struct
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fastavro
from confluent_kafka import KafkaError

from capture.encoder import frame
from capture.schemas import Registrar
from headwater.errors import FatalError
from headwater.topics import UndecodableMessage
from streams.catalog import Schemas, TableTopic
from streams.config import StreamsConfig
from streams.cursor import Cursor
from streams.fanout import STREAMED, Change
from streams.joins import Joiner, canon, store_key, view_schema
from streams.rows import lsn_text, pack, unpack
from streams.writer import Pending, TableWriter
from tables.partition import partition_for
from tables.views import LSN_FIELD, TableShape, ViewSpec

log = logging.getLogger("headwater.streams")
HIGH = b"@high"  # no state write comes from a raw offset above this one
PROGRESS = b"@progress"  # replay starts here: (raw offset, watermark) after the last published cut
PROGRESS_FORMAT = struct.Struct(">qqi")
CUT_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "ViewCut",
    "namespace": "headwater",
    "doc": "The view topic read up to these ends shows every source transaction up to commit_lsn, none after.",
    "fields": [
        {"name": "view", "type": "string"},
        {"name": "commit_lsn", "type": "long"},
        {"name": "topic", "type": "string"},
        {"name": "ends", "type": {"type": "array", "items": {
            "type": "record", "name": "PartitionEnd",
            "fields": [{"name": "partition", "type": "int"}, {"name": "offset", "type": "long"}]}}},
    ],
}  # fmt: skip
CUT_PARSED = fastavro.parse_schema(CUT_SCHEMA)
KEY_STRING = fastavro.parse_schema("string")


def avro_bytes(schema: Any, datum: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema, datum)
    return out.getvalue()


@dataclass
class ViewTopic:
    """A view's topic, schemas (registered) and how far Kafka acknowledged it."""

    spec: ViewSpec
    topic: str
    schema: dict[str, Any]
    value_frame: bytes
    key_columns: list[str]
    key_frame: bytes
    key_parsed: Any
    parsed: Any = field(init=False, repr=False)
    ends: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.parsed = fastavro.parse_schema(self.schema)

    def encode(self, doc: dict[str, Any], lsn: int) -> bytes:
        return self.value_frame + avro_bytes(self.parsed, {**doc, LSN_FIELD: lsn})

    def decode(self, value: bytes) -> dict[str, Any]:
        return dict(fastavro.schemaless_reader(io.BytesIO(value[5:]), self.parsed, None))  # type: ignore[arg-type]

    def key(self, row: dict[str, Any]) -> bytes:
        return self.key_frame + avro_bytes(self.key_parsed, {c: row[c] for c in self.key_columns})


class Delivered(Pending):
    """A ``Pending`` that also remembers the end offset of every partition it wrote to."""

    __slots__ = ("ends",)

    def __init__(self) -> None:
        super().__init__()
        self.ends: dict[tuple[str, int], int] = {}

    def delivered(self, error: KafkaError | None, msg: Any) -> None:
        super().delivered(error, msg)
        if error is None:
            at = (msg.topic(), msg.partition())
            self.ends[at] = max(self.ends.get(at, 0), msg.offset() + 1)


def shapes_of(tables: Sequence[TableTopic], schemas: Schemas) -> tuple[dict[str, TableShape], dict[str, Any]]:
    """The captured tables' columns and key (for validation) and their latest value schemas."""
    shapes, values = {}, {}
    for t in tables:
        latest = schemas.latest(f"{t.topic}-value")
        if latest is None:
            continue
        values[t.qualified] = latest[1]
        columns = tuple(f["name"] for f in latest[1]["fields"])
        shapes[t.qualified] = TableShape(t.qualified, columns, tuple(t.key.columns))
    return shapes, values


def setup_views(cfg: StreamsConfig, specs: Sequence[ViewSpec], tables: Sequence[TableTopic], schemas: Schemas,
                writer: TableWriter) -> tuple[dict[str, ViewTopic], dict[str, TableShape]]:  # fmt: skip
    """Validate the specs, register the views' schemas and make their topics (and the cuts topic)."""
    shapes, values = shapes_of(tables, schemas)
    for spec in specs:
        spec.check(shapes)
    registrar = Registrar(cfg.registry_url, setting="[streams] registry_url")
    by_table = {t.qualified: t for t in tables}
    out = {}
    for spec in specs:
        topic = cfg.view_topic(spec.name)
        schema = view_schema(spec, values)
        base_key = by_table[spec.base].key
        out[spec.name] = ViewTopic(
            spec, topic, schema, frame(registrar.register(f"{topic}-value", schema, table=f"view {spec.name}")),
            base_key.columns, frame(registrar.register(f"{topic}-key", base_key.schema)), base_key.parsed,
        )  # fmt: skip
    if out:
        writer.ensure_topics([v.topic for v in out.values()])
        writer.ensure_topics([cfg.cuts_topic], partitions=1)
        found = writer.ends([v.topic for v in out.values()])
        for v in out.values():
            v.ends = {p: found.get((v.topic, p), 0) for p in range(cfg.partitions)}
    return out, shapes


class Materializer:
    """Keeps the views: join state, dirty rows, emission at consistent points, cuts."""

    def __init__(self, cfg: StreamsConfig, views: dict[str, ViewTopic], shapes: dict[str, TableShape],
                 store: MutableMapping[bytes, bytes], writer: TableWriter, schemas: Schemas) -> None:  # fmt: skip
        self.cfg = cfg
        self.views = views
        self.shapes = shapes
        self.store = store
        self.writer = writer
        self.schemas = schemas
        self.joiner: Joiner | None = None
        self.cursor = Cursor(cfg.changes_topic, "views", lambda: writer.low_watermark(cfg.changes_topic))
        self.watermark = (-1, -1)
        self.quiet_until = -1  # replaying: publish nothing at points below this raw offset
        self.cut: int | None = None  # commit LSN of the last published cut
        self.cut_frame: bytes | None = None
        self.key_frame: bytes | None = None
        self.published = 0  # view rows written (changed) since start

    def load(self) -> Joiner:
        """(Re)build the join state from the recovered table; replay starts at the saved progress."""
        self.joiner = Joiner([v.spec for v in self.views.values()], self.shapes, self.store, self.schemas.decode)
        saved = self.store.get(PROGRESS)
        start, lsn, position = PROGRESS_FORMAT.unpack(saved) if saved else (0, -1, -1)
        self.cursor.reset(start)
        self.watermark = (lsn, position)
        high = self.store.get(HIGH)
        self.quiet_until = int.from_bytes(high, "big", signed=True) if high else -1
        dirty = sum(len(d) for d in self.joiner.dirty.values())
        log.info("views %s resume at raw offset %d (quiet until %d, %d rows dirty)", ", ".join(self.views), start,
                 self.quiet_until, dirty)  # fmt: skip
        return self.joiner

    async def handle(self, batch: Sequence[tuple[int, bytes | None]]) -> int | None:
        """Apply a batch of (raw offset, value); publish at its last consistent point. A seek, if needed."""
        joiner = self.joiner or self.load()
        changes, seek = self._admit(batch)
        if not changes:
            return seek
        self.store[HIGH] = changes[-1][0].to_bytes(8, "big", signed=True)  # before any write of the batch
        points = [i for i, (offset, c) in enumerate(changes) if c.ends_transaction and offset >= self.quiet_until]
        last = points[-1] if points else -1
        for _, change in changes[: last + 1]:
            joiner.apply(change)
        if last >= 0:
            await self.publish(changes[last][0], changes[last][1].commit_lsn)
        for _, change in changes[last + 1 :]:
            joiner.apply(change)
        return seek

    def _admit(self, batch: Sequence[tuple[int, bytes | None]]) -> tuple[list[tuple[int, Change]], int | None]:
        """The batch's new, decodable, not-yet-seen changes (the fan-out dead-letters the rest)."""
        out, seek = [], None
        for offset, value in batch:
            admitted, asked = self.cursor.admit(offset)
            seek = asked or seek
            if not admitted or value is None:
                continue
            try:
                change = Change.from_record(self.schemas.decode(value))
            except (UndecodableMessage, KeyError, TypeError):
                continue
            if change.op in STREAMED:
                ident = (change.commit_lsn, change.position)
                if ident <= self.watermark:
                    continue  # capture sent it twice
                self.watermark = ident
            out.append((offset, change))
        return out, seek

    async def publish(self, offset: int, lsn: int) -> None:
        """Write the changed view rows as of ``lsn``, then the cuts, then forget the dirty marks."""
        assert self.joiner is not None
        delivered = Delivered()  # its own: the fan-out's ledger orders the fan-out's checkpoints
        written = {name: self._write(view, lsn, delivered) for name, view in self.views.items()}
        await asyncio.get_running_loop().run_in_executor(None, self.writer.flush)
        if delivered.failed is not None:
            raise FatalError(f"Kafka refused a view row: {delivered.failed}",
                             hint="check the broker log and the view topics' settings")  # fmt: skip
        for view in self.views.values():
            for partition in range(self.cfg.partitions):
                end = delivered.ends.get((view.topic, partition))
                if end is not None:
                    view.ends[partition] = max(view.ends.get(partition, 0), end)
            self._write_cut(view, lsn)
        for name, docs in written.items():
            for key, value in docs.items():
                doc_key = store_key(b"v", name, key)
                if value is None:
                    self.store.pop(doc_key, None)
                else:
                    self.store[doc_key] = pack(lsn, 0, value)
            self.joiner.clear(name, list(docs))
        for name in self.views:
            self.joiner.clear(name, sorted(self.joiner.dirty[name]))
        self.store[PROGRESS] = PROGRESS_FORMAT.pack(offset + 1, *self.watermark)
        self.cut = lsn

    def _write(self, view: ViewTopic, lsn: int, delivered: Delivered) -> dict[bytes, bytes | None]:
        """Write each dirty row of ``view`` that changed; its new stored value (None: gone) by key."""
        assert self.joiner is not None
        out: dict[bytes, bytes | None] = {}
        for key in sorted(self.joiner.dirty[view.spec.name]):
            doc = self.joiner.document(view.spec.name, key)
            stored = self.store.get(store_key(b"v", view.spec.name, key))
            if doc is None:
                if stored is None:
                    continue
                key_bytes, value = view.key(view.decode(unpack(stored)[2])), None
            else:
                if stored is not None:
                    old_lsn, _, old = unpack(stored)
                    if view.encode(doc, old_lsn) == old:
                        continue  # unchanged: nothing to write
                key_bytes, value = view.key(doc), view.encode(doc, lsn)
            partition = partition_for(key_bytes, self.cfg.partitions)
            headers = [("hw.lsn", b"%d" % lsn), ("hw.view", view.spec.name.encode())]
            self.writer.produce(view.topic, partition, key_bytes, value, headers, delivered)
            out[key] = value
            self.published += 1
        return out

    def _write_cut(self, view: ViewTopic, lsn: int) -> None:
        if self.cut_frame is None or self.key_frame is None:
            registrar = Registrar(self.cfg.registry_url, setting="[streams] registry_url")
            self.cut_frame = frame(registrar.register(f"{self.cfg.cuts_topic}-value", CUT_SCHEMA))
            self.key_frame = frame(registrar.register(f"{self.cfg.cuts_topic}-key", {"type": "string"}))
        ends = [{"partition": p, "offset": o} for p, o in sorted(view.ends.items())]
        value = self.cut_frame + avro_bytes(CUT_PARSED, {"view": view.spec.name, "commit_lsn": lsn,
                                                         "topic": view.topic, "ends": ends})  # fmt: skip
        key = self.key_frame + avro_bytes(KEY_STRING, view.spec.name)
        self.writer.produce(self.cfg.cuts_topic, 0, key, value, [("hw.lsn", b"%d" % lsn)])

    def row(self, view: str, key: bytes) -> tuple[int, dict[str, Any]] | None:
        """(commit LSN, document) of a view row as last published, or None."""
        stored = self.store.get(store_key(b"v", view, key))
        if stored is None:
            return None
        lsn, _, value = unpack(stored)
        return lsn, self.views[view].decode(value)

    def describe(self) -> dict[str, Any]:
        return {"cut_lsn": None if self.cut is None else lsn_text(self.cut), "rows_published": self.published,
                "views": [{"name": v.spec.name, "base": v.spec.base, "topic": v.topic, "key": v.key_columns,
                           "joins": [j.path for j in v.spec.joins]} for v in self.views.values()]}  # fmt: skip


def decode_cut(value: bytes) -> dict[str, Any]:
    """A cut record's value (Confluent-framed ``ViewCut``)."""
    return dict(fastavro.schemaless_reader(io.BytesIO(value[5:]), CUT_PARSED, None))  # type: ignore[arg-type]


def view_key(view: ViewTopic, key_bytes: bytes) -> bytes:
    """The store key of a view row from the base table's framed key bytes."""
    record: Any = fastavro.schemaless_reader(io.BytesIO(key_bytes[5:]), view.key_parsed, None)
    return canon([record[c] for c in view.key_columns])
