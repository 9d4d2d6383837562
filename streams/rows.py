"""Table rows as the workers keep them and as the endpoint shows them.

Promise: pure. A table value is the row's Confluent-framed Avro bytes behind the
``(commit_lsn, position)`` of the change that wrote it (``pack``/``unpack``).
``to_json`` renders a decoded row with types kept readable: decimals as strings
(exact), timestamps and dates ISO-8601 (UTC ones with ``Z``), bytes base64, uuids
as text, nulls as null. ``dumps`` is ``json.dumps(to_json(value))`` (compact) made by the
json module's C encoder, which calls back only for the values JSON has no type for: the
Redis mirror's rendering of a view row took 55% of its thread in ``to_json`` at the 180k
shop (py-spy); ``dumps`` renders the same bytes in half the time (15 against 31 µs for a
shop order's document; ``tests/streams/test_rows.py`` holds the bytes equal).
"""

from __future__ import annotations

import base64
import json
import struct
import uuid
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any

HEAD = struct.Struct(">qi")


def pack(commit_lsn: int, position: int, value: bytes) -> bytes:
    return HEAD.pack(commit_lsn, position) + value


def unpack(data: bytes) -> tuple[int, int, bytes]:
    commit_lsn, position = HEAD.unpack_from(data)
    return commit_lsn, position, data[HEAD.size :]


def to_json(value: Any) -> Any:
    """A decoded Avro value as JSON-ready data (see the module promise)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.isoformat()
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return str(value)


_COMPACT = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=to_json)


def dumps(value: Any) -> bytes:
    """``json.dumps(to_json(value), separators=(",", ":"))`` as UTF-8 bytes, in C where JSON has the types."""
    try:
        return _COMPACT.encode(value).encode()
    except ValueError:  # NaN or an infinity, which to_json writes as text
        return json.dumps(to_json(value), separators=(",", ":")).encode()
