"""The pgoutput logical replication protocol (version 1), decoded as pure functions.

Promise: ``decode(payload)`` turns one pgoutput message (the bytes psycopg2 hands
over for each XLogData) into one immutable dataclass, with no I/O and no state.
Column values are PostgreSQL's text output (``str``; ``bytes`` for binary-format
columns), ``None`` for NULL, or ``UNCHANGED`` for a TOASTed value the update did not touch; turning text into typed
values is ``tables.types``'s job. Unknown or truncated messages raise
``DecodeError`` naming the message kind and offset.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

PG_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)


class _Unchanged:
    """Marker for an unchanged TOASTed column in an Update's new tuple ('u')."""

    _instance: _Unchanged | None = None

    def __new__(cls) -> _Unchanged:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()
Value = str | bytes | None | _Unchanged
Tuple = tuple[Value, ...]


class DecodeError(ValueError):
    """A pgoutput message that is not what the protocol says."""


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int  # LSN of the commit record
    commit_time: int  # microseconds since 2000-01-01 UTC
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int  # end of the commit record: what the slot may confirm
    commit_time: int


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int
    typmod: int
    is_key: bool


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]


@dataclass(frozen=True, slots=True)
class Type:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relation_oid: int
    new: Tuple


@dataclass(frozen=True, slots=True)
class Update:
    relation_oid: int
    old: Tuple | None  # key columns ('K') or the whole old row ('O'), when PostgreSQL sends them
    old_kind: str | None  # 'K', 'O' or None
    new: Tuple


@dataclass(frozen=True, slots=True)
class Delete:
    relation_oid: int
    old: Tuple
    old_kind: str  # 'K' or 'O'


@dataclass(frozen=True, slots=True)
class Truncate:
    relation_oids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class Message:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


PgOutput = Begin | Commit | Origin | Relation | Type | Insert | Update | Delete | Truncate | Message

_I8 = struct.Struct("!b")
_I16 = struct.Struct("!h")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_BEGIN = struct.Struct("!QqI")
_COMMIT = struct.Struct("!bQQq")
_REL_HEAD = struct.Struct("!I")


def pg_time(micros: int) -> datetime:
    """A pgoutput timestamp (µs since 2000-01-01 UTC) as an aware datetime."""
    return PG_EPOCH + timedelta(microseconds=micros)


def _string(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(b"\0", pos)
    return buf[pos:end].decode("utf-8"), end + 1


def _tuple(buf: bytes, pos: int) -> tuple[Tuple, int]:
    (count,) = _I16.unpack_from(buf, pos)
    pos += 2
    values: list[Value] = []
    for _ in range(count):
        kind = buf[pos]
        pos += 1
        if kind == 0x74:  # 't' text
            (size,) = _I32.unpack_from(buf, pos)
            pos += 4
            values.append(buf[pos : pos + size].decode("utf-8"))
            pos += size
        elif kind == 0x62:  # 'b' binary
            (size,) = _I32.unpack_from(buf, pos)
            pos += 4
            values.append(bytes(buf[pos : pos + size]))
            pos += size
        elif kind == 0x6E:  # 'n'
            values.append(None)
        elif kind == 0x75:  # 'u'
            values.append(UNCHANGED)
        else:
            raise DecodeError(f"unknown tuple column kind {chr(kind)!r} at offset {pos - 1}")
    if pos > len(buf):
        raise DecodeError(f"truncated tuple: {count} columns need {pos} bytes, the message has {len(buf)}")
    return tuple(values), pos


def _relation(buf: bytes) -> Relation:
    (oid,) = _REL_HEAD.unpack_from(buf, 1)
    namespace, pos = _string(buf, 5)
    name, pos = _string(buf, pos)
    identity = chr(buf[pos])
    (count,) = _I16.unpack_from(buf, pos + 1)
    pos += 3
    columns = []
    for _ in range(count):
        flags = buf[pos]
        col, pos = _string(buf, pos + 1)
        type_oid, typmod = struct.unpack_from("!Ii", buf, pos)
        pos += 8
        columns.append(Column(col, type_oid, typmod, bool(flags & 1)))
    return Relation(oid, namespace, name, identity, tuple(columns))


def _insert(buf: bytes) -> Insert:
    (oid,) = _U32.unpack_from(buf, 1)
    if buf[5] != 0x4E:  # 'N'
        raise DecodeError(f"Insert: expected 'N' at offset 5, got {chr(buf[5])!r}")
    new, _ = _tuple(buf, 6)
    return Insert(oid, new)


def _update(buf: bytes) -> Update:
    (oid,) = _U32.unpack_from(buf, 1)
    pos = 5
    old: Tuple | None = None
    old_kind = None
    if buf[pos] in (0x4B, 0x4F):  # 'K' or 'O'
        old_kind = chr(buf[pos])
        old, pos = _tuple(buf, pos + 1)
    if buf[pos] != 0x4E:
        raise DecodeError(f"Update: expected 'N' at offset {pos}, got {chr(buf[pos])!r}")
    new, _ = _tuple(buf, pos + 1)
    return Update(oid, old, old_kind, new)


def _delete(buf: bytes) -> Delete:
    (oid,) = _U32.unpack_from(buf, 1)
    kind = chr(buf[5])
    if kind not in "KO":
        raise DecodeError(f"Delete: expected 'K' or 'O' at offset 5, got {kind!r}")
    old, _ = _tuple(buf, 6)
    return Delete(oid, old, kind)


def _truncate(buf: bytes) -> Truncate:
    count, options = struct.unpack_from("!ib", buf, 1)
    oids = struct.unpack_from(f"!{count}I", buf, 6)
    return Truncate(tuple(oids), bool(options & 1), bool(options & 2))


def _message(buf: bytes) -> Message:
    flags, lsn = struct.unpack_from("!bQ", buf, 1)
    prefix, pos = _string(buf, 10)
    (size,) = _I32.unpack_from(buf, pos)
    return Message(bool(flags & 1), lsn, prefix, bytes(buf[pos + 4 : pos + 4 + size]))


def _begin(buf: bytes) -> Begin:
    return Begin(*_BEGIN.unpack_from(buf, 1))


def _commit(buf: bytes) -> Commit:
    return Commit(*_COMMIT.unpack_from(buf, 1))


def _origin(buf: bytes) -> Origin:
    (lsn,) = struct.unpack_from("!Q", buf, 1)
    name, _ = _string(buf, 9)
    return Origin(lsn, name)


def _type(buf: bytes) -> Type:
    (oid,) = _U32.unpack_from(buf, 1)
    namespace, pos = _string(buf, 5)
    name, _ = _string(buf, pos)
    return Type(oid, namespace, name)


_DECODERS: dict[int, Callable[[bytes], PgOutput]] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("O"): _origin,
    ord("R"): _relation,
    ord("Y"): _type,
    ord("I"): _insert,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
    ord("M"): _message,
}


def decode(payload: bytes) -> PgOutput:
    """Decode one pgoutput message."""
    if not payload:
        raise DecodeError("empty pgoutput message")
    decoder = _DECODERS.get(payload[0])
    if decoder is None:
        raise DecodeError(
            f"unsupported pgoutput message kind {chr(payload[0])!r}"
            " (streamed transactions need proto_version 1 without 'streaming')"
        )
    try:
        return decoder(payload)
    except (struct.error, IndexError, ValueError) as exc:
        if isinstance(exc, DecodeError):
            raise
        raise DecodeError(f"truncated or malformed {chr(payload[0])!r} message: {exc}") from exc
