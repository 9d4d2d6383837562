"""What the workers serve: the captured tables, found through the schema registry.

Promise: ``discover`` lists the table topics capture registered under the topic prefix
(``<topic>-value`` subjects whose schema names its ``pg.table``), or the tables named in
``[streams] tables``; ``registered`` those not among topics already known (a running worker's look for
tables captured since it started); ``rekeyed_tables`` those whose records are keyed with another key
schema now than the one they are served with (the fan-out's checkpoint says which); ``KeyCodec``
turns key columns given as text (a URL) into the exact key bytes capture wrote, and
key bytes back into columns. Registry failures raise ``RetryableError``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import date
from decimal import Decimal, InvalidOperation
from typing import Any

import fastavro

from streams.config import StreamsConfig
from streams.errors import KeyError400
from tables.errors import FatalError
from tables.registry import Registry
from tables.topics import key_subject, table_topic_of_subject
from tables.wire import SCHEMA_VIEW, avro_body, frame


def _parse(text: str, avro: Any) -> Any:
    """One key column from URL text, by its Avro type; ``ValueError`` if it does not fit."""
    if isinstance(avro, list):  # key columns are never null, but accept a nullable union
        avro = next(t for t in avro if t != "null")
    kind = avro if isinstance(avro, str) else avro.get("type")
    logical = None if isinstance(avro, str) else avro.get("logicalType")
    if logical == "decimal":
        value = Decimal(text)
        if not value.is_finite():
            raise ValueError("not a finite number")
        return value.quantize(Decimal(1).scaleb(-int(avro.get("scale", 0))))
    if logical == "uuid":
        return str(uuid.UUID(text))
    if logical == "date":
        return date.fromisoformat(text)
    if kind in ("int", "long"):
        return int(text)
    if kind == "string":
        return text
    if kind == "boolean" and text in ("true", "false"):
        return text == "true"
    if kind == "enum" and text in avro["symbols"]:
        return text
    raise ValueError(f"keys of Avro type {json.dumps(avro)} cannot be given in a URL")


@dataclass
class KeyCodec:
    """A table's key record: URL text to key bytes (as capture framed them)."""

    schema_id: int
    schema: dict[str, Any]
    parsed: Any = field(init=False, repr=False)
    frame: bytes = field(init=False, repr=False)  # what precedes a key record of this schema

    def __post_init__(self) -> None:
        self.parsed = fastavro.parse_schema(self.schema)
        self.frame = frame(self.schema_id)

    @property
    def columns(self) -> list[str]:
        return [f["name"] for f in self.schema["fields"]]

    def encode_text(self, text: str) -> bytes:
        """``42`` or ``7,abc`` (key columns in order) to framed key bytes; ``KeyError400`` if malformed."""
        fields = self.schema["fields"]
        parts = text.split(",") if len(fields) > 1 else [text]
        if len(parts) != len(fields):
            raise KeyError400(f"the key has {len(fields)} columns ({', '.join(self.columns)}), got {len(parts)}")
        record = {}
        for part, f in zip(parts, fields, strict=True):
            try:
                record[f["name"]] = _parse(part, f["type"])
            except (ValueError, InvalidOperation, StopIteration) as exc:
                raise KeyError400(f"key column {f['name']}: {part!r} is not valid ({exc})") from exc
        return frame(self.schema_id) + avro_body(self.parsed, record)


@dataclass
class TableTopic:
    qualified: str  # schema.table in PostgreSQL
    topic: str
    key: KeyCodec

    @property
    def short(self) -> str:
        """``table`` for public tables, else ``schema.table``: how URLs name it."""
        schema, _, name = self.qualified.partition(".")
        return name if schema == "public" else self.qualified


def discover(cfg: StreamsConfig, schemas: Registry) -> list[TableTopic]:
    """The table topics capture registered (keyed ones only), in name order."""
    found = registered(cfg, schemas)
    wanted = cfg.table_names
    missing = [t for t in wanted if t not in found]
    if missing:
        raise FatalError(
            f"[streams] tables: {', '.join(missing)} not registered under topic prefix {cfg.topic_prefix!r} "
            f"in {schemas.url}",
            hint="run headwater capture for these tables first (it registers their schemas), or fix the names",
        )
    return served(cfg, found)


def served(cfg: StreamsConfig, found: dict[str, TableTopic]) -> list[TableTopic]:
    """The tables of ``found`` the workers serve (``[streams] tables``, else all), in name order."""
    wanted = cfg.table_names
    return [found[q] for q in sorted(found) if not wanted or q in wanted]


def registered(cfg: StreamsConfig, schemas: Registry, skip: Collection[str] = ()) -> dict[str, TableTopic]:
    """schema.table -> its topic, for the keyed tables capture registered whose topics are not in ``skip``."""
    found: dict[str, TableTopic] = {}
    for subject in sorted(schemas.subjects()):
        topic = table_topic_of_subject(cfg.topic_prefix, subject)
        if topic is None or topic in skip:
            continue
        value = schemas.latest(subject)
        key = schemas.latest(key_subject(topic))
        qualified = value[1].get("pg.table") if value and isinstance(value[1], dict) else None
        if qualified is None or key is None or SCHEMA_VIEW in value[1]:  # type: ignore[index]
            continue  # not a captured table, or one without key (not served)
        found[qualified] = TableTopic(qualified, topic, KeyCodec(key[0], key[1]))
    return found


def rekeyed_tables(tables: Sequence[TableTopic], schemas: Registry, written: Mapping[str, int]) -> list[TableTopic]:
    """Those of ``tables`` whose records are keyed with another key schema than they read keys with, with it (a key
    column's type changed: the fan-out moved their rows to it, ``streams.fanout.Rekey``). ``written``: table topic ->
    the key schema id the fan-out's checkpoint says its records have."""
    out = []
    for table in tables:
        now = key_in_use(table, schemas, written)
        if now is not None and now.schema_id != table.key.schema_id:
            out.append(replace(table, key=now))
    return out


def key_in_use(table: TableTopic, schemas: Registry, written: Mapping[str, int]) -> KeyCodec | None:
    """The key schema ``table``'s records are keyed with: the one ``written`` names for its topic, else (a topic the
    fan-out has not written since it keeps them) the key subject's newest. Not simply the newest: a key changed and
    changed back registers nothing new (the registry answers the first version's id), so the newest version stays the
    one in between while the rows are moved back."""
    schema_id = written.get(table.topic)
    if schema_id is None:
        latest = schemas.latest(key_subject(table.topic))
        return None if latest is None else KeyCodec(latest[0], latest[1])
    return table.key if schema_id == table.key.schema_id else KeyCodec(schema_id, schemas.schema(schema_id))
