"""Rows to Avro in the Confluent wire format, with the table's registered schema ids.

Promise: ``RowEncoder`` converts a row of PostgreSQL text values with the table's
converters and writes it with fastavro, prefixed by magic byte 0 and the 4-byte
schema id. A value the Avro type cannot hold raises ``UnsupportedValueError`` naming
table and column. ``encode_change`` writes one raw-topic record the same way.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

import fastavro

from capture.errors import UnsupportedValueError
from capture.types import UnsupportedValue
from tables.catalog import TableSchema
from tables.change import CHANGE_KEY_SCHEMA, CHANGE_VALUE_SCHEMA

Text = str | None


def frame(schema_id: int) -> bytes:
    return b"\0" + schema_id.to_bytes(4, "big")


class AvroWriter:
    """One parsed schema and its registered id: ``encode(record)`` gives framed bytes."""

    def __init__(self, schema: dict[str, Any], schema_id: int) -> None:
        self.parsed = fastavro.parse_schema(json.loads(json.dumps(schema)))
        self.prefix = frame(schema_id)

    def encode(self, record: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        out.write(self.prefix)
        fastavro.schemaless_writer(out, self.parsed, record)
        return out.getvalue()


class RowEncoder:
    """Encodes rows of one table shape (value and key)."""

    def __init__(self, table: TableSchema, value_id: int, key_id: int | None) -> None:
        self.table = table
        self.value = AvroWriter(table.value_schema, value_id)
        self.key = AvroWriter(table.key_schema, key_id) if table.key_schema and key_id is not None else None
        self.names = table.field_names
        self.key_indexes = table.key_indexes
        self.converters = table.converters

    def convert(self, texts: Sequence[Text]) -> list[Any]:
        out: list[Any] = []
        for i, (text, conv) in enumerate(zip(texts, self.converters, strict=True)):
            if text is None:
                out.append(None)
                continue
            try:
                out.append(conv(text))
            except (UnsupportedValue, ValueError, ArithmeticError) as exc:
                raise UnsupportedValueError(self.table.qualified, self.table.columns[i].name, str(exc)) from exc
        return out

    def encode_value(self, values: Sequence[Any]) -> bytes:
        try:
            return self.value.encode(dict(zip(self.names, values, strict=True)))
        except (ValueError, TypeError) as exc:
            raise UnsupportedValueError(self.table.qualified, "?", f"cannot encode row: {exc}") from exc

    def encode_key(self, values: Sequence[Any]) -> bytes | None:
        """The key record from a full row (or from a key-only old tuple, same positions)."""
        if self.key is None:
            return None
        return self.key.encode({self.names[i]: values[i] for i in self.key_indexes})


class ChangeWriter:
    """Encodes raw-topic keys and values."""

    def __init__(self, key_id: int, value_id: int) -> None:
        self.key = AvroWriter(CHANGE_KEY_SCHEMA, key_id)
        self.value = AvroWriter(CHANGE_VALUE_SCHEMA, value_id)
        self._keys: dict[tuple[str, str], bytes] = {}

    def encode_key(self, schema: str, table: str) -> bytes:
        found = self._keys.get((schema, table))
        if found is None:
            found = self._keys[(schema, table)] = self.key.encode({"schema": schema, "table": table})
        return found

    def encode(self, change: dict[str, Any]) -> bytes:
        return self.value.encode(change)
