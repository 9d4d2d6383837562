"""Registering table and raw-topic schemas with a Confluent-compatible registry.

Promise: ``Registrar.register(subject, schema)`` returns the schema id, asking the
registry once per distinct schema (``schema(id)`` reads one back); an unreachable registry is a
``RegistryUnavailableError`` naming the URL, a refused (incompatible) table schema a
``SchemaChangeError`` naming the table and subject.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from capture.errors import RegistryUnavailableError, SchemaChangeError
from headwater.errors import FatalError
from tables.catalog import TableSchema


def shown(url: str) -> str:
    """``url`` without a password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"))


class Registrar:
    """A Confluent-compatible registry's ``POST /subjects/{subject}/versions`` (the standard
    library's HTTP client: capture starts faster without a client library; basic auth from the
    URL's user and password, TLS verified)."""

    def __init__(self, url: str, *, setting: str = "[capture] registry_url") -> None:
        self.url = url.rstrip("/")
        self.setting = setting  # where the user sets the URL, for the hint
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FatalError(f"{setting} = {shown(url)!r} is not an http(s) URL", hint="e.g. http://127.0.0.1:8081")
        self._base = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self._headers = {"Content-Type": "application/vnd.schemaregistry.v1+json", "Accept": "application/json"}
        if parts.username is not None:
            user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self._headers["Authorization"] = "Basic " + base64.b64encode(user.encode()).decode()
        self._ids: dict[tuple[str, str], int] = {}

    def register(self, subject: str, schema: dict[str, Any], *, table: str | None = None) -> int:
        text = json.dumps(schema, separators=(",", ":"))
        cached = self._ids.get((subject, text))
        if cached is not None:
            return cached
        self._ids[(subject, text)] = schema_id = self._post(subject, text, table)
        return schema_id

    def _post(self, subject: str, text: str, table: str | None) -> int:
        status, body = self._request(f"/subjects/{quote(subject, safe='')}/versions", {"schema": text})
        if status == 200 and isinstance(body.get("id"), int):
            return int(body["id"])
        message = str(body.get("message", body.get("text", "")))
        if status == 409 and table is not None:
            raise SchemaChangeError(table, subject, message)
        if status >= 500:
            raise RegistryUnavailableError(f"schema registry at {shown(self.url)} failed: {message}")
        code = body.get("error_code", status)
        raise FatalError(f"the schema registry at {shown(self.url)} refused '{subject}': {message} ({code})")

    def schema(self, schema_id: int) -> dict[str, Any]:
        """The schema registered under ``schema_id`` (``GET /schemas/ids/{id}``)."""
        status, body = self._request(f"/schemas/ids/{schema_id}", None)
        if status == 200 and isinstance(body.get("schema"), str):
            return dict(json.loads(body["schema"]))
        if status >= 500:
            raise RegistryUnavailableError(f"schema registry at {shown(self.url)} failed: {body}")
        raise FatalError(f"the schema registry at {shown(self.url)} has no schema {schema_id} ({status})",
                         hint="point registry_url at the registry the raw topic was written with")  # fmt: skip

    def _request(self, path: str, payload: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        """POST ``payload`` (GET when None): (HTTP status, the JSON answer, or {"text": ...} when it is not JSON)."""
        data = None if payload is None else json.dumps(payload).encode()
        method = "GET" if payload is None else "POST"
        request = urllib.request.Request(self._base + path, data, self._headers, method=method)  # noqa: S310 - http(s)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - checked in __init__
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, OSError) as exc:
            raise RegistryUnavailableError(
                f"schema registry at {shown(self.url)} is unreachable: {getattr(exc, 'reason', exc)}",
                hint=f"start it ('headwater stack up') or set {self.setting}",
            ) from exc
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        return status, body if isinstance(body, dict) else {"text": raw[:200].decode("utf-8", "replace")}

    def close(self) -> None:
        return None  # no connection is kept between requests


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
