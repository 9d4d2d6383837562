"""Registering table and raw-topic schemas with a Confluent-compatible registry.

Promise: ``Registrar.register(subject, schema)`` returns the schema id, asking the
registry once per distinct schema; an unreachable registry is a
``RegistryUnavailableError`` naming the URL, a refused (incompatible) table schema a
``SchemaChangeError`` naming the table and subject.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from capture.errors import RegistryUnavailableError, SchemaChangeError
from headwater.errors import FatalError
from tables.catalog import TableSchema


def shown(url: str) -> str:
    """``url`` without a password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class Registrar:
    """A Confluent-compatible registry's ``POST /subjects/{subject}/versions``, over one HTTP client
    (basic auth from the URL's user and password; TLS verified)."""

    def __init__(self, url: str, *, setting: str = "[capture] registry_url") -> None:
        self.url = url.rstrip("/")
        self.setting = setting  # where the user sets the URL, for the hint
        self.client = httpx.Client(timeout=10)
        self._ids: dict[tuple[str, str], int] = {}

    def register(self, subject: str, schema: dict[str, Any], *, table: str | None = None) -> int:
        text = json.dumps(schema, separators=(",", ":"))
        cached = self._ids.get((subject, text))
        if cached is not None:
            return cached
        self._ids[(subject, text)] = schema_id = self._post(subject, text, table)
        return schema_id

    def _post(self, subject: str, text: str, table: str | None) -> int:
        where = shown(self.url)
        try:
            response = self.client.post(f"{self.url}/subjects/{quote(subject, safe='')}/versions",
                                        json={"schema": text}, headers={"Accept": "application/json"})  # fmt: skip
        except httpx.HTTPError as exc:
            raise RegistryUnavailableError(
                f"schema registry at {where} is unreachable: {exc}",
                hint=f"start it ('headwater stack up') or set {self.setting}",
            ) from exc
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.status_code == 200 and isinstance(body, dict) and isinstance(body.get("id"), int):
            return body["id"]
        message = body.get("message", response.text[:200]) if isinstance(body, dict) else response.text[:200]
        if response.status_code == 409 and table is not None:
            raise SchemaChangeError(table, subject, message)
        if response.status_code >= 500:
            raise RegistryUnavailableError(f"schema registry at {where} failed: {message}")
        code = body.get("error_code", response.status_code) if isinstance(body, dict) else response.status_code
        raise FatalError(f"the schema registry at {where} refused '{subject}': {message} ({code})")

    def close(self) -> None:
        self.client.close()


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
