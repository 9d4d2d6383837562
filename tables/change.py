"""The raw change topic's record: one change with its source position.

Promise: the Avro schemas of ``<prefix>.changes`` keys and values, shared by the
capture agent that writes them and the stream agents that read them. Row images
(``key``, ``before``, ``after``) come in one of two encodings (capture's ``raw_images``):

* ``framed`` (``CHANGE_VALUE_SCHEMA``, registered as ``<topic>-value``): each image is bytes,
  already encoded in the Confluent wire format with the table topic's own registered
  schemas, so a fan-out forwards the bytes;
* ``nested`` (``nested_change_schema``, one record per table shape, registered under
  ``<topic>-<record name>``, Confluent's TopicRecordNameStrategy): each image is the table's
  own key or value record inside the change, so any Avro consumer reads a whole change with
  the one schema its id names. ``before`` is the full old row (the table's value record) or
  the old key (its key record), as in ``framed``; SNAPSHOT_END, which names no table, is a
  ``headwater.Marker`` (``MARKER_SCHEMA``).

``ChangeReader`` reads messages of either encoding as records with framed images, the form
the fan-out, the views and reconciliation work on.
``(commit_lsn, position)`` identifies a change; snapshot rows carry one below the slot's
consistent point as ``commit_lsn`` (a streamed transaction may commit at the point itself)
and a ``position`` unique within the snapshot.
A backfill (an incremental snapshot of one table while the stream runs) writes each
chunk as one transaction of READ rows (and of DELETEs for keys the table no longer
holds) at its high watermark's commit: ``commit_lsn``, ``xid`` and ``commit_time`` of
that commit, ``position``/``tx_size`` within the chunk, and ``backfill`` naming the
backfill. ``backfill`` was added with a default (null), so records written before it
read as before; it is the last field, and writers put new fields after it.
``decode_change`` reads a message as plain data, its row images decoded too.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import fastavro

from tables.avro import compile_schema, define_once, named_types, plain
from tables.topics import key_subject, value_subject
from tables.wire import FRAME_SIZE, UndecodableMessage, frame, schema_id

OPS: Final = ("READ", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "SNAPSHOT_END")

CHANGE_KEY_SCHEMA: Final[dict[str, Any]] = {
    "type": "record",
    "name": "ChangeKey",
    "namespace": "headwater",
    "fields": [{"name": "schema", "type": "string"}, {"name": "table", "type": "string"}],
}

CHANGE_VALUE_SCHEMA: Final[dict[str, Any]] = {
    "type": "record",
    "name": "Change",
    "namespace": "headwater",
    "doc": "One committed change (or snapshot read) of a PostgreSQL row, in commit order.",
    "fields": [
        {"name": "op", "type": {"type": "enum", "name": "Op", "symbols": list(OPS)}},
        {"name": "schema", "type": "string"},
        {"name": "table", "type": "string"},
        {"name": "topic", "type": "string", "doc": "the table's own topic"},
        {"name": "commit_lsn", "type": "long",
         "doc": "LSN of the commit record (snapshot: one below the consistent point)"},
        {"name": "xid", "type": "long"},
        {"name": "commit_time", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "position", "type": "int", "doc": "0-based place of this change in its transaction"},
        {"name": "tx_size", "type": "int", "doc": "changes in the transaction (snapshot rows: 0, see SNAPSHOT_END)"},
        {"name": "key", "type": ["null", "bytes"], "default": None, "doc": "Confluent-framed key record"},
        {"name": "before", "type": ["null", "bytes"], "default": None, "doc": "old row or key, when sent"},
        {"name": "after", "type": ["null", "bytes"], "default": None, "doc": "Confluent-framed full new row"},
        {"name": "backfill", "type": ["null", "long"], "default": None,
         "doc": "the backfill (incremental snapshot) a READ row or retraction belongs to: its number; else null"},
    ],
}

IMAGES: Final = ("key", "before", "after")
IMAGE_DOCS: Final = {
    "key": "the table's key record",
    "before": "old row (the table's value record) or old key (its key record), when sent",
    "after": "the full new row (the table's value record)",
}


def _fullname(record: dict[str, Any]) -> str:
    return f"{record['namespace']}.{record['name']}"


def _with_images(name: str, namespace: str, doc: str, types: dict[str, list[Any]]) -> dict[str, Any]:
    """The change record with ``types`` for its image fields, which come last (``after`` ends the record: a reader
    cuts it out without reading it), after ``CHANGE_VALUE_SCHEMA``'s other fields."""
    fields = [f for f in CHANGE_VALUE_SCHEMA["fields"] if f["name"] not in IMAGES]
    fields += [{"name": n, "type": types[n], "default": None, "doc": IMAGE_DOCS[n]} for n in IMAGES]
    fields[0] = {"name": "op", "type": {**fields[0]["type"], "namespace": "headwater"}}  # headwater.Op, as in framed
    return define_once({"type": "record", "name": name, "namespace": namespace, "doc": doc, "fields": fields})


def nested_change_schema(value: dict[str, Any], key: dict[str, Any] | None) -> dict[str, Any]:
    """The raw-topic change record of one table shape (``value``/``key``: the table topic's schemas) with its
    row images nested: ``<value's full name>.Change``, e.g. ``headwater.public.orders.Change``."""
    keys = [key] if key is not None else []
    types = {"key": ["null", *keys], "before": ["null", value, *keys], "after": ["null", value]}
    doc = f"One committed change (or snapshot read) of a row of {value.get('pg.table', _fullname(value))}."
    return _with_images("Change", _fullname(value), doc, types)


MARKER_SCHEMA: Final[dict[str, Any]] = _with_images(
    "Marker", "headwater", "A change of no table (SNAPSHOT_END) on a raw topic with nested row images.",
    {"key": ["null"], "before": ["null"], "after": ["null"]},
)


def decode_change(value: bytes, decode: Callable[[bytes | None], Any]) -> dict[str, Any]:
    """A raw-topic message as plain data: the change record with its row images decoded as well.

    ``decode`` reads one Confluent-framed record, None staying None: ``tables.registry.Registry(url)``
    is one (schemas fetched once per id), as is confluent-kafka's ``AvroDeserializer`` wrapped.
    Nested images come decoded with the change; framed ones are decoded by a second ``decode``.
    """
    record = dict(decode(value))
    for name in IMAGES:
        image = record.get(name)
        record[name] = decode(image) if isinstance(image, bytes) else image
    return record


class Registrar(Protocol):
    """What ``ChangeReader`` asks of a registry (``tables.registry.Registry``)."""

    def schema(self, schema_id: int) -> dict[str, Any]: ...

    def decode(self, data: bytes | None) -> Any: ...

    def register(self, subject: str, schema: dict[str, Any], *, table: str | None = None) -> int: ...


class ChangeReader:
    """Reads raw-topic messages of either image encoding as change records whose images are framed bytes.

    A framed change is the record as decoded. A nested one's images are each the table's own record, whose
    Avro body is what ``framed`` carries behind the frame: they are cut out of the message (the fields up to
    the images decoded, the key and a full old row read to find where they end, ``after`` running to the end
    of the record) and framed with the id the registry gives the table's schema under ``<topic>-value`` /
    ``<topic>-key`` — the ids capture registered. A nested schema whose images do not end the record is read
    whole instead (images without logical types) and each image written again with the table's schema
    (``tables.avro``): the same bytes (``cut=False`` reads every nested record so: the reference the tests hold
    the cut to). Plans are made once per schema id; a message no plan reads is an ``UndecodableMessage``.
    """

    def __init__(self, registry: Registrar, *, cut: bool = True) -> None:
        self.registry, self.cut = registry, cut
        self._plans: dict[int, _Nested | None] = {}

    def __call__(self, value: bytes) -> dict[str, Any]:
        writer = schema_id(value)
        plan = self._plans[writer] if writer in self._plans else self._plan(writer)
        if plan is None:
            return dict(self.registry.decode(value))
        return plan.read(value, self.registry)

    def _plan(self, writer: int) -> _Nested | None:
        schema = self.registry.schema(writer)
        types = {f["name"]: f["type"] for f in schema.get("fields", ())}
        images = [types.get(name) for name in IMAGES]
        nested = any(isinstance(t, list) and any(isinstance(b, dict | str) and b not in ("null", "bytes")
                                                  for b in t) for t in images)  # fmt: skip
        self._plans[writer] = plan = _Nested.of(schema, self.cut) if nested else None
        return plan


DECODE_ERRORS = (EOFError, ValueError, IndexError, KeyError, UnicodeDecodeError, TypeError)
Branches = dict[int, tuple[Any, bool]]  # an image's union tag byte -> (its record's plain parse, the key record?)


@dataclass
class _Nested:
    """How to read one nested change schema: its parses and each image's table schema."""

    parsed: Any  # the whole record, images plain
    value: dict[str, Any] | None  # the table topic's value schema, standing alone
    key: dict[str, Any] | None
    encode_value: Callable[[Any], bytes] | None
    encode_key: Callable[[Any], bytes] | None
    head: Any = None  # the fields before the images, when the images end the record (else None: read whole)
    branches: tuple[Branches, Branches] = ({}, {})  # key's, before's
    frames: tuple[bytes, bytes] | None = None  # (value frame, key frame), once the topic is known

    @classmethod
    def of(cls, schema: dict[str, Any], cut: bool = True) -> _Nested:
        known = named_types(schema)
        fields = [{**f, "type": plain(f["type"])} if f["name"] in IMAGES else f for f in schema["fields"]]
        parsed = fastavro.parse_schema({**schema, "fields": fields})
        value, key = _branch(schema, "after", known), _branch(schema, "key", known)
        plan = cls(parsed, value, key, _encoder(value), _encoder(key))
        if cut and [f["name"] for f in schema["fields"][-3:]] == list(IMAGES):
            plan.head = fastavro.parse_schema({**schema, "fields": schema["fields"][:-3]})
            plan.branches = (_tags(schema["fields"][-3], known, key), _tags(schema["fields"][-2], known, key))
        return plan

    def read(self, data: bytes, registry: Registrar) -> dict[str, Any]:
        try:
            return self._cut(data, registry) if self.head is not None else self._whole(data, registry)
        except DECODE_ERRORS as exc:
            raise UndecodableMessage(f"Avro body does not match schema {schema_id(data)}: {exc!r}") from exc

    def _cut(self, data: bytes, registry: Registrar) -> dict[str, Any]:
        stream = io.BytesIO(data)
        stream.seek(FRAME_SIZE)
        record: Any = fastavro.schemaless_reader(stream, self.head, None)
        at = stream.tell()
        if data[at:] == b"\x00\x00\x00":  # no image: a truncate
            record.update(key=None, before=None, after=None)
            return dict(record)
        value_frame, key_frame = self.frames or self._frames(record, registry)
        frames = (value_frame, key_frame)
        record["key"], at = _take(data, stream, at, self.branches[0], frames)
        record["before"], at = _take(data, stream, at, self.branches[1], frames)
        tag = data[at]
        if tag not in (0, 2):
            raise ValueError(f"union branch {tag >> 1} of after")
        record["after"] = value_frame + data[at + 1 :] if tag else None
        return dict(record)

    def _whole(self, data: bytes, registry: Registrar) -> dict[str, Any]:
        record: Any = fastavro.schemaless_reader(io.BytesIO(memoryview(data)[FRAME_SIZE:]), self.parsed, None,
                                                 return_record_name=True, return_record_name_override=True)  # fmt: skip
        if record["key"] is None and record["before"] is None and record["after"] is None:
            return record
        value_frame, key_frame = self.frames or self._frames(record, registry)
        if record["key"] is not None:
            record["key"] = key_frame + _call(self.encode_key, record["key"])
        before = record["before"]
        if isinstance(before, tuple):  # (record name, row): the old key or the full old row
            name, before = before
            is_key = self.key is not None and name == _fullname(self.key)
            record["before"] = (key_frame + _call(self.encode_key, before) if is_key
                                else value_frame + _call(self.encode_value, before))  # fmt: skip
        elif before is not None:
            record["before"] = value_frame + _call(self.encode_value, before)
        if record["after"] is not None:
            record["after"] = value_frame + _call(self.encode_value, record["after"])
        return dict(record)

    def _frames(self, record: dict[str, Any], registry: Registrar) -> tuple[bytes, bytes]:
        topic, table = record["topic"], f"{record['schema']}.{record['table']}"
        value_id = registry.register(value_subject(topic), self.value, table=table) if self.value else 0
        key_id = registry.register(key_subject(topic), self.key, table=table) if self.key else 0
        self.frames = frame(value_id), frame(key_id)
        return self.frames


def _take(data: bytes, stream: io.BytesIO, at: int, branches: Branches, frames: tuple[bytes, bytes]
          ) -> tuple[bytes | None, int]:  # fmt: skip
    """The framed image at ``at`` (null, or the record of its union branch, read to find its end) and the offset
    after it."""
    tag = data[at]
    if tag == 0:
        return None, at + 1
    parsed, is_key = branches[tag]
    stream.seek(at + 1)
    fastavro.schemaless_reader(stream, parsed, None)
    end = stream.tell()
    return (frames[1] if is_key else frames[0]) + data[at + 1 : end], end


def _tags(field: dict[str, Any], known: dict[str, Any], key: dict[str, Any] | None) -> Branches:
    """An image field's union branches: tag byte (the branch index, zig-zag) -> the record's plain parse."""
    out: Branches = {}
    for index, branch in enumerate(field["type"]):
        if branch != "null":
            record = define_once(known[branch] if isinstance(branch, str) else branch, known)
            is_key = key is not None and _fullname(record) == _fullname(key)
            out[index << 1] = fastavro.parse_schema(plain(record)), is_key
    return out


def _encoder(schema: dict[str, Any] | None) -> Callable[[Any], bytes] | None:
    return None if schema is None else compile_schema(plain(schema))


def _call(encode: Callable[[Any], bytes] | None, row: Any) -> bytes:
    if encode is None:
        raise UndecodableMessage("a row image of a schema that has no record for it")
    return encode(row)


def _branch(schema: dict[str, Any], field: str, known: dict[str, Any]) -> dict[str, Any] | None:
    """The record an image field holds besides null (``after``: the value, ``key``: the key), standing alone."""
    for f in schema["fields"]:
        if f["name"] == field:
            records = [b for b in f["type"] if b != "null"]
            return dict(define_once(records[0], known)) if records else None
    return None
