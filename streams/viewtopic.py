"""The views' topics: each view's spec, topic, registered schemas and key encoding.

Promise: ``setup_views`` validates the view specs against the captured tables, registers each
view's value and key schemas and makes the view topics (compacted), the cuts topic and the views'
points and fragments topics (an hour's retention: ``streams.frontier``); a
``ViewTopic`` encodes a view row (Avro, Confluent frame, the commit LSN inside) and its key (the
base table's key record under the view's key subject). ``view_key`` maps a base row's framed key
to the join state's key of its view row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import fastavro

from streams.catalog import KeyCodec, TableTopic
from streams.config import StreamsConfig
from streams.joins import canon, view_schema
from streams.writer import TableWriter
from tables.registry import Registry
from tables.views import LSN_FIELD, TableShape, ViewSpec
from tables.wire import FRAME_SIZE, avro_body, body, frame, read_framed

LONG = fastavro.parse_schema("long")
COORDINATION_RETENTION_MS = 3_600_000  # the points and fragments topics: only their last records are read


@dataclass
class ViewTopic:
    """A view's spec, topic, schema, the frames of its registered subjects and its key codec."""

    spec: ViewSpec
    topic: str
    schema: dict[str, Any]
    value_frame: bytes
    key_frame: bytes  # the view's key subject; the body is the base table's key record
    codec: KeyCodec  # the base table's key
    others: Callable[[bytes], Any] | None = None  # reads a value framed with another schema (the registry's decode)
    parsed: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.parsed = fastavro.parse_schema(self.schema)
        last = self.schema["fields"][-1]
        if (last["name"], last["type"]) != (LSN_FIELD, "long"):  # content() and at() rely on it
            raise RuntimeError(f"view {self.spec.name}: {LSN_FIELD} must be the schema's last field, a long")

    @property
    def key_columns(self) -> list[str]:
        return self.codec.columns

    def encode(self, doc: dict[str, Any], lsn: int) -> bytes:
        return self.value_frame + avro_body(self.parsed, {**doc, LSN_FIELD: lsn})

    def content(self, doc: dict[str, Any]) -> bytes:
        """A document's value without its commit LSN (the last field; zig-zag 0 is one byte): what two
        versions of a row are compared by. Encoding is most of a publication's time: done once a row."""
        return self.encode(doc, 0)[:-1]

    @staticmethod
    def at(content: bytes, lsn: int) -> bytes:
        """The value of a view row: its content followed by the commit LSN it reflects."""
        return content + avro_body(LONG, lsn)

    @staticmethod
    def content_of(value: bytes, lsn: int) -> bytes | None:
        """A value's content, given the commit LSN it carries (None: it does not end with that LSN)."""
        tail = avro_body(LONG, lsn)
        return value[: -len(tail)] if value.endswith(tail) else None

    def decode(self, value: bytes) -> dict[str, Any]:
        """A view row's value, read with the schema its frame names (a wider one may have followed it)."""
        if value[:FRAME_SIZE] == self.value_frame or self.others is None:
            return dict(read_framed(value, self.parsed))
        return dict(self.others(value))

    def key(self, row: dict[str, Any]) -> bytes:
        return self.key_frame + avro_body(self.codec.parsed, {c: row[c] for c in self.key_columns})

    def key_of_base_key(self, base_key: bytes) -> bytes:
        """The view key of a base row from its framed key record (``codec``'s): the same body under the view's
        key frame."""
        return self.key_frame + body(base_key)


def shapes_of(tables: Sequence[TableTopic], schemas: Registry) -> tuple[dict[str, TableShape], dict[str, Any]]:
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


def setup_views(cfg: StreamsConfig, specs: Sequence[ViewSpec], tables: Sequence[TableTopic], schemas: Registry,
                writer: TableWriter) -> tuple[dict[str, ViewTopic], dict[str, TableShape]]:  # fmt: skip
    """Validate the specs, register the views' schemas and make their topics (and the cuts topic)."""
    shapes, values = shapes_of(tables, schemas)
    for spec in specs:
        spec.check(shapes)
    registrar = Registry(cfg.registry_url, setting="registry_url in [pipeline] or [streams]")
    by_table = {t.qualified: t for t in tables}
    out = {}
    for spec in specs:
        topic = cfg.view_topic(spec.name)
        schema = view_schema(spec, values, {q: s.key for q, s in shapes.items()})
        base_key = by_table[spec.base].key
        out[spec.name] = ViewTopic(
            spec, topic, schema, frame(registrar.register(f"{topic}-value", schema, table=f"view {spec.name}")),
            frame(registrar.register(f"{topic}-key", base_key.schema)), base_key, schemas.decode,
        )  # fmt: skip
    if out:
        writer.ensure_topics([v.topic for v in out.values()])
        writer.ensure_topics([cfg.cuts_topic], partitions=1)
        writer.ensure_topics([cfg.points_topic, cfg.fragments_topic], partitions=1, compact=False,
                             config={"retention.ms": str(COORDINATION_RETENTION_MS)})  # fmt: skip
    return out, shapes


def view_key(view: ViewTopic, key_bytes: bytes) -> bytes:
    """The store key of a view row from the base table's framed key bytes."""
    record = read_framed(key_bytes, view.codec.parsed)
    return canon([record[c] for c in view.key_columns])
