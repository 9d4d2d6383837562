"""Registering table and raw-topic schemas with a Confluent-compatible registry.

Promise: ``Registrar.register(subject, schema)`` returns the schema id, asking the
registry once per distinct schema; an unreachable registry is a
``RegistryUnavailableError`` naming the URL, a refused (incompatible) table schema a
``SchemaChangeError`` naming the table and subject.
"""

from __future__ import annotations

import json
from typing import Any

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from capture.errors import RegistryUnavailableError, SchemaChangeError
from headwater.errors import FatalError
from tables.catalog import TableSchema


class Registrar:
    def __init__(self, url: str, *, setting: str = "[capture] registry_url") -> None:
        self.url = url
        self.setting = setting  # where the user sets the URL, for the hint
        self.client = SchemaRegistryClient({"url": url, "timeout": 10})
        self._ids: dict[tuple[str, str], int] = {}

    def register(self, subject: str, schema: dict[str, Any], *, table: str | None = None) -> int:
        text = json.dumps(schema, separators=(",", ":"))
        cached = self._ids.get((subject, text))
        if cached is not None:
            return cached
        try:
            schema_id = int(self.client.register_schema(subject, Schema(text, "AVRO")))
        except SchemaRegistryError as exc:
            if exc.http_status_code == 409 and table is not None:
                raise SchemaChangeError(table, subject, exc.error_message) from exc
            if exc.http_status_code in (-1, 0) or exc.http_status_code >= 500:
                raise RegistryUnavailableError(f"schema registry at {self.url} failed: {exc.error_message}") from exc
            raise FatalError(
                f"the schema registry at {self.url} refused '{subject}': {exc.error_message} ({exc.error_code})"
            ) from exc
        except Exception as exc:  # httpx connection errors and the like
            raise RegistryUnavailableError(
                f"schema registry at {self.url} is unreachable: {exc}",
                hint=f"start it ('headwater stack up') or set {self.setting}",
            ) from exc
        self._ids[(subject, text)] = schema_id
        return schema_id

    def close(self) -> None:
        self.client.__exit__()


class NoRegistry:
    """The ``json`` format registers nothing: every schema id is 0."""

    url = ""

    def register(self, subject: str, schema: dict[str, Any], *, table: str | None = None) -> int:
        return 0

    def close(self) -> None:
        return None


def register_table(registrar: Registrar | NoRegistry, table: TableSchema) -> tuple[int, int | None]:
    """Register a table topic's value (and key, when it has one) schema: (value id, key id)."""
    value_id = registrar.register(f"{table.topic}-value", table.value_schema, table=table.qualified)
    key_id = (
        registrar.register(f"{table.topic}-key", table.key_schema, table=table.qualified) if table.key_schema else None
    )
    return value_id, key_id
