"""Registering a captured table's schemas.

Promise: ``register_table`` registers a table topic's value schema (and its key schema, when the
table has a key) under ``<topic>-value`` / ``<topic>-key`` and returns their ids; a refused
schema is a ``SchemaChangeError`` naming the table and subject (see ``tables.registry``).
"""

from __future__ import annotations

from tables.catalog import TableSchema
from tables.registry import NoRegistry, Registry


def register_table(registry: Registry | NoRegistry, table: TableSchema) -> tuple[int, int | None]:
    """Register a table topic's value (and key, when it has one) schema: (value id, key id)."""
    value_id = registry.register(f"{table.topic}-value", table.value_schema, table=table.qualified)
    key_id = (
        registry.register(f"{table.topic}-key", table.key_schema, table=table.qualified) if table.key_schema else None
    )
    return value_id, key_id
