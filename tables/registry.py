"""The one client of a Confluent-compatible schema registry that every component uses.

Promise: ``Registry.register(subject, schema)`` returns the registry's schema id, asking once
per distinct schema; ``schema(id)`` is the JSON schema registered under an id and ``parsed(id)``
the same parsed for fastavro (fetched once per id); ``decode(framed)`` reads a Confluent-framed
record with its writer schema (a flat record by ``tables.flatavro``'s compiled reader, the rest by
fastavro: the same result); ``subjects()`` and ``latest(subject)`` list what is registered.
An unreachable or failing registry is a ``RegistryUnavailableError`` (retryable) naming the URL
and the setting to fix, a refused table schema a ``SchemaChangeError`` naming the table and
subject, a record that is not framed Avro of a registered schema an ``UndecodableMessage``.
The URL's user and password become basic auth and are never shown (``shown``). No I/O before a
method is called.

Why the standard library's HTTP client and not python-schema-registry-client: capture imports
this module on its start-up path, which issue 3 measured to the tenth of a second (capture's
imports: 0.31 s). Importing ``schema_registry.client`` takes 0.09 s on this machine
(``urllib.request``: 0.02 s), and the calls Headwater needs are four REST requests whose errors
it maps itself either way. Measure with
``python -c "import time; t=time.perf_counter(); import schema_registry.client; print(time.perf_counter()-t)"``.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import fastavro

from tables.errors import FatalError, RegistryUnavailableError, SchemaChangeError
from tables.flatavro import reader
from tables.wire import FRAME_SIZE, UndecodableMessage, read_framed, schema_id

DECODE_ERRORS = (EOFError, ValueError, IndexError, KeyError, UnicodeDecodeError, TypeError)


def shown(url: str) -> str:
    """``url`` without a password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"))


def _text(schema: dict[str, Any]) -> str:
    """A schema as ``register`` sends it, and remembers its id by."""
    return json.dumps(schema, separators=(",", ":"))


class Registry:
    """A Confluent-compatible registry over HTTP(S): basic auth from the URL, TLS verified."""

    def __init__(self, url: str, *, setting: str = "registry_url") -> None:
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
        self._parsed: dict[int, Any] = {}
        self._readers: dict[int, Any] = {}  # schema id -> its compiled reader, or None (fastavro reads it)

    def __repr__(self) -> str:
        return f"Registry({shown(self.url)!r})"

    def register(self, subject: str, schema: dict[str, Any], *, table: str | None = None) -> int:
        """The id of ``schema`` under ``subject`` (registered if new); ``table`` names a refusal."""
        text = _text(schema)
        cached = self._ids.get((subject, text))
        if cached is not None:
            return cached
        self._ids[(subject, text)] = found = self._post(subject, text, table)
        return found

    def known(self, subject: str, schema: dict[str, Any]) -> int | None:
        """The id ``register`` gave ``schema`` under ``subject`` in this process, if it did (no request)."""
        return self._ids.get((subject, _text(schema)))

    def _post(self, subject: str, text: str, table: str | None) -> int:
        status, body = self._request(f"/subjects/{quote(subject, safe='')}/versions", {"schema": text})
        if status == 200 and isinstance(body.get("id"), int):
            return int(body["id"])
        message = str(body.get("message", body.get("text", "")))
        if status == 409 and table is not None:
            raise SchemaChangeError(table, subject, message)
        self._fail(status, body)
        code = body.get("error_code", status)
        raise FatalError(f"the schema registry at {shown(self.url)} refused '{subject}': {message} ({code})")

    def schema(self, schema_id: int) -> dict[str, Any]:
        """The schema registered under ``schema_id`` (``UndecodableMessage`` if there is none)."""
        status, body = self._request(f"/schemas/ids/{schema_id}", None)
        if status == 200 and isinstance(body.get("schema"), str):
            return dict(json.loads(body["schema"]))
        self._fail(status, body)
        raise UndecodableMessage(f"schema id {schema_id} is not in the registry at {shown(self.url)}",
                                 hint=f"point {self.setting} at the registry the topic was written with")  # fmt: skip

    def parsed(self, schema_id: int) -> Any:
        """``schema(id)`` parsed for fastavro, fetched once per id."""
        found = self._parsed.get(schema_id)
        if found is None:
            found = self._parsed[schema_id] = fastavro.parse_schema(self.schema(schema_id))
        return found

    def decode(self, data: bytes | None) -> Any:
        """A Confluent-framed record read with its writer schema (None stays None)."""
        if data is None:
            return None
        writer = schema_id(data)
        compiled = self._readers[writer] if writer in self._readers else self._reader(writer)
        try:
            return read_framed(data, self._parsed[writer]) if compiled is None else compiled.read(data, FRAME_SIZE)
        except DECODE_ERRORS as exc:
            raise UndecodableMessage(f"Avro body does not match schema {writer}: {exc!r}") from exc

    __call__ = decode

    def _reader(self, schema_id: int) -> Any:
        found = self._readers[schema_id] = reader(self.parsed(schema_id))
        return found

    def subjects(self) -> list[str]:
        status, body = self._request("/subjects", None)
        if status == 200 and isinstance(body.get("list"), list):
            return [str(s) for s in body["list"]]
        self._fail(status, body)
        raise FatalError(f"the schema registry at {shown(self.url)} answered GET /subjects with {status}")

    def latest(self, subject: str) -> tuple[int, dict[str, Any]] | None:
        """(id, schema) of ``subject``'s newest version, or None when the subject does not exist."""
        status, body = self._request(f"/subjects/{quote(subject, safe='')}/versions/latest", None)
        if status == 200 and isinstance(body.get("schema"), str):
            return int(body["id"]), json.loads(body["schema"])
        if status == 404:
            return None
        self._fail(status, body)
        raise FatalError(f"the schema registry at {shown(self.url)} answered {subject} latest with {status}")

    def _fail(self, status: int, body: dict[str, Any]) -> None:
        if status >= 500 or status in (408, 429):
            raise RegistryUnavailableError(f"schema registry at {shown(self.url)} failed ({status}): "
                                           f"{str(body.get('message', body.get('text', '')))[:200]}")  # fmt: skip

    def _request(self, path: str, payload: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        """POST ``payload`` (GET when None): (HTTP status, the JSON answer, a list as {"list": ...},
        or {"text": ...} when it is not JSON)."""
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
            return status, {"text": raw[:200].decode("utf-8", "replace")}
        return status, body if isinstance(body, dict) else {"list": body}

    def close(self) -> None:
        return None  # no connection is kept between requests


class NoRegistry:
    """The ``json`` format registers nothing: every schema id is 0."""

    url = ""

    def register(self, subject: str, schema: dict[str, Any], *, table: str | None = None) -> int:
        return 0

    def close(self) -> None:
        return None
