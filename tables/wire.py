"""The wire contract every topic keeps: the Confluent frame, Headwater's record headers, LSN text.

Promise: this module is the one place these are written down. ``frame(id)`` is the 5-byte
Confluent prefix (magic byte 0, 4-byte big-endian schema id) and ``schema_id``/``body`` read
it back (``UndecodableMessage`` when the bytes are not framed); ``avro_body``/``read_framed``
encode and read with a parsed schema the caller holds. The ``HEADER_*`` names are the
headers Headwater writes on table, view, cut and dead-letter records, ``SCHEMA_*`` the
properties that mark a view's schema. ``lsn_text``/``parse_lsn``
turn an LSN into PostgreSQL's ``X/X`` notation and back. Pure: no I/O.
"""

from __future__ import annotations

import io
from typing import Any

import fastavro

from tables.errors import FatalError

MAGIC = 0
FRAME_SIZE = 5

HEADER_OP = "hw.op"  # a table record's operation (r, c, u, d, t)
HEADER_RAW = "hw.raw"  # the raw-topic offset (and sub-position) it came from
HEADER_LSN = "hw.lsn"  # the commit LSN (decimal) a table, view or cut record reflects
HEADER_POS = "hw.pos"  # the change's position inside its transaction
HEADER_VIEW = "hw.view"  # the view a view record belongs to
HEADER_SOURCE_TOPIC = "hw.source.topic"  # dead letters: where the undecodable record was
HEADER_SOURCE_PARTITION = "hw.source.partition"
HEADER_SOURCE_OFFSET = "hw.source.offset"
HEADER_ERROR = "hw.error"  # dead letters: why it could not be decoded
SCHEMA_VIEW = "hw.view"  # a view topic's value schema names its view under this property
SCHEMA_BASE = "hw.base"  # ... and its base table under this one


class UndecodableMessage(FatalError):
    """A record that is not Confluent-framed Avro of a schema the registry holds."""


def frame(schema_id: int) -> bytes:
    """The Confluent prefix of a record written with registered schema ``schema_id``."""
    return bytes((MAGIC,)) + schema_id.to_bytes(4, "big")


def schema_id(data: bytes) -> int:
    """The schema id of a framed record (``UndecodableMessage`` if ``data`` is not framed)."""
    if len(data) < FRAME_SIZE or data[0] != MAGIC:
        raise UndecodableMessage("not the Confluent wire format (magic byte 0 and a schema id)")
    return int.from_bytes(data[1:FRAME_SIZE], "big")


def body(data: bytes) -> bytes:
    """A framed record without its frame: the Avro body (the bytes that identify a key's value)."""
    return data[FRAME_SIZE:]


def avro_body(parsed: Any, datum: Any) -> bytes:
    """``datum`` Avro-encoded with a parsed schema (no Confluent frame)."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parsed, datum)
    return out.getvalue()


def read_framed(data: bytes, parsed: Any) -> Any:
    """A Confluent-framed record read with a schema the caller already holds (the frame is skipped)."""
    return fastavro.schemaless_reader(io.BytesIO(memoryview(data)[FRAME_SIZE:]), parsed, None)


def lsn_text(lsn: int) -> str:
    """An LSN in PostgreSQL's X/X notation."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """PostgreSQL's X/X notation as an integer (``ValueError`` if it is not that)."""
    high, slash, low = text.partition("/")
    if not slash:
        raise ValueError(f"{text!r} is not an LSN (X/X, hexadecimal)")
    return (int(high, 16) << 32) | int(low, 16)
