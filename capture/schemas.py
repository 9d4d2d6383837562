"""Registering a captured table's schemas, and the raw topic's.

Promise: ``register_table`` registers a table topic's value schema (and its key schema, when the
table has a key) under ``<topic>-value`` / ``<topic>-key`` and, when the raw topic nests row images
(``raw_images = "nested"``), the table shape's change record under ``<raw topic>-<record name>``;
it returns their ids. ``register_changes`` registers the raw topic's key schema and the value
schema its writer starts with: the framed change record under ``<raw topic>-value``, or for nested
images the marker record (SNAPSHOT_END) under ``<raw topic>-headwater.Marker``. A refused schema
is a ``SchemaChangeError`` naming the table and subject (see ``tables.registry``).
"""

from __future__ import annotations

from typing import NamedTuple

from capture.config import CaptureConfig
from tables.catalog import TableSchema
from tables.change import CHANGE_KEY_SCHEMA, CHANGE_VALUE_SCHEMA, MARKER_SCHEMA, nested_change_schema
from tables.registry import NoRegistry, Registry
from tables.topics import key_subject, record_subject, value_subject


class Ids(NamedTuple):
    """A table shape's registered schema ids."""

    value: int
    key: int | None
    change: int | None = None  # its nested change record on the raw topic (raw_images = "nested"), else None


def register_table(registry: Registry | NoRegistry, table: TableSchema, cfg: CaptureConfig | None = None) -> Ids:
    """Register a table topic's value (and key, when it has one) schema, and with ``cfg.nested`` the table
    shape's change record on the raw topic."""
    value_id = registry.register(value_subject(table.topic), table.value_schema, table=table.qualified)
    key_id = (
        registry.register(key_subject(table.topic), table.key_schema, table=table.qualified)
        if table.key_schema
        else None
    )
    if cfg is None or not cfg.nested:
        return Ids(value_id, key_id)
    change = nested_change_schema(table.value_schema, table.key_schema)
    subject = record_subject(cfg.changes_topic, f"{change['namespace']}.{change['name']}")
    return Ids(value_id, key_id, registry.register(subject, change, table=table.qualified))


def register_changes(registry: Registry | NoRegistry, cfg: CaptureConfig) -> tuple[int, int]:
    """(key id, value id) of the raw topic's writer: the framed change record, or the nested marker."""
    key_id = registry.register(key_subject(cfg.changes_topic), CHANGE_KEY_SCHEMA)
    if not cfg.nested:
        return key_id, registry.register(value_subject(cfg.changes_topic), CHANGE_VALUE_SCHEMA)
    subject = record_subject(cfg.changes_topic, f"{MARKER_SCHEMA['namespace']}.{MARKER_SCHEMA['name']}")
    return key_id, registry.register(subject, MARKER_SCHEMA)
