"""The raw change topic's record: one change with its source position.

Promise: the Avro schemas of ``<prefix>.changes`` keys and values, shared by the
capture agent that writes them and the stream agents that read them. Row images
(``key``, ``before``, ``after``) are already encoded in the Confluent wire format
with the table topic's own registered schemas, so a fan-out forwards the bytes.
``(commit_lsn, position)`` identifies a change; snapshot rows carry the slot's
consistent point as ``commit_lsn`` and a ``position`` unique within the snapshot.
A backfill (an incremental snapshot of one table while the stream runs) writes each
chunk as one transaction of READ rows (and of DELETEs for keys the table no longer
holds) at its high watermark's commit: ``commit_lsn``, ``xid`` and ``commit_time`` of
that commit, ``position``/``tx_size`` within the chunk, and ``backfill`` naming the
backfill. ``backfill`` was added with a default (null), so records written before it
read as before; it is the last field, and writers put new fields after it.
``decode_change`` reads a message as plain data, its row images decoded too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

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
        {"name": "commit_lsn", "type": "long", "doc": "LSN of the commit record (snapshot: consistent point)"},
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


def decode_change(value: bytes, decode: Callable[[bytes | None], Any]) -> dict[str, Any]:
    """A raw-topic message as plain data: the change record with its row images decoded as well.

    ``decode`` reads one Confluent-framed record, None staying None: ``tables.registry.Registry(url)``
    is one (schemas fetched once per id), as is confluent-kafka's ``AvroDeserializer`` wrapped.
    """
    record = dict(decode(value))
    for name in IMAGES:
        record[name] = decode(record.get(name))
    return record
