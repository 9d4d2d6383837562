"""Registering a captured table's schemas, and the raw topic's.

Promise: ``register_table`` registers a table topic's value schema (and its key schema, when the
table has a key) under ``<topic>-value`` / ``<topic>-key`` and, when the raw topic nests row images
(``raw_images = "nested"``), the table shape's change record under ``<raw topic>-<record name>``;
it returns their ids. ``register_changes`` registers the raw topic's key schema and the value
schema its writer starts with: the framed change record under ``<raw topic>-value``, or for nested
images the marker record (SNAPSHOT_END) under ``<raw topic>-headwater.Marker``. A refused schema
is a ``SchemaChangeError`` naming the table and subject (see ``tables.registry``). A key schema that changed
is warned of: the table topics keep the records of the old key.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from capture.config import CaptureConfig
from tables.catalog import TableSchema
from tables.change import CHANGE_KEY_SCHEMA, CHANGE_VALUE_SCHEMA, MARKER_SCHEMA, nested_change_schema
from tables.logs import facts
from tables.registry import NoRegistry, Registry
from tables.topics import key_subject, record_subject, value_subject

log = logging.getLogger("headwater.capture")


class Ids(NamedTuple):
    """A table shape's registered schema ids."""

    value: int
    key: int | None
    change: int | None = None  # its nested change record on the raw topic (raw_images = "nested"), else None


def register_table(registry: Registry | NoRegistry, table: TableSchema, cfg: CaptureConfig | None = None) -> Ids:
    """Register a table topic's value (and key, when it has one) schema, and with ``cfg.nested`` the table
    shape's change record on the raw topic."""
    value_id = registry.register(value_subject(table.topic), table.value_schema, table=table.qualified)
    key_id = _register_key(registry, table) if table.key_schema else None
    if cfg is None or not cfg.nested:
        return Ids(value_id, key_id)
    change = nested_change_schema(table.value_schema, table.key_schema)
    subject = record_subject(cfg.changes_topic, f"{change['namespace']}.{change['name']}")
    return Ids(value_id, key_id, registry.register(subject, change, table=table.qualified))


def _register_key(registry: Registry | NoRegistry, table: TableSchema) -> int:
    """The key schema's id; a key column's type or name changed (int made bigint, a numeric's scale, a rename) is
    warned of when its key schema becomes the subject's newest version (``key_changed``; once: a key changed back
    to an older version is not). Asked of the registry only when this process did not register it before."""
    subject, schema = key_subject(table.topic), table.key_schema or {}
    if not isinstance(registry, Registry) or registry.known(subject, schema) is not None:
        return registry.register(subject, schema, table=table.qualified)
    before = registry.latest(subject)
    key_id = registry.register(subject, schema, table=table.qualified)
    if before is not None and before[0] != key_id:
        now = registry.latest(subject)  # the newest version only when this registration made it
        if now is not None and now[0] == key_id:
            key_changed(table, before[0], key_id)
    return key_id


def key_changed(table: TableSchema, was: int, now: int) -> None:
    """A new key schema means new key bytes for the same rows: the workers' fan-out moves the table topic's rows to
    it (``streams.fanout.Rekey``), but a consumer keyed by the bytes of its own sees both (README, Schema changes)."""
    log.warning("the key of %s changed (key schema id %d, was %d): the same rows get other key bytes; the workers "
                "move the rows of table topic %s to the new key at its first change (a tombstone for each old key), "
                "and consumers that keep rows by key bytes see each row under both keys until then",
                table.qualified, now, was, table.topic,
                extra=facts(table=table.qualified, topic=table.topic))  # fmt: skip


def register_changes(registry: Registry | NoRegistry, cfg: CaptureConfig) -> tuple[int, int]:
    """(key id, value id) of the raw topic's writer: the framed change record, or the nested marker."""
    key_id = registry.register(key_subject(cfg.changes_topic), CHANGE_KEY_SCHEMA)
    if not cfg.nested:
        return key_id, registry.register(value_subject(cfg.changes_topic), CHANGE_VALUE_SCHEMA)
    subject = record_subject(cfg.changes_topic, f"{MARKER_SCHEMA['namespace']}.{MARKER_SCHEMA['name']}")
    return key_id, registry.register(subject, MARKER_SCHEMA)
