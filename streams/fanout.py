"""The fan-out's decisions: which raw change becomes which record on which table topic.

Promise: pure (no I/O). ``FanOut.route`` turns one decoded raw change at a raw offset
into the records to write — key, full row or tombstone, the Java-murmur2 partition —
and drops what was already written, so a replay changes nothing downstream:

* a change the capture sent twice (after a capture crash it replays from the last
  confirmed commit) has a ``(commit_lsn, position)`` at or below the watermark of
  streamed changes already seen, and is dropped;
* a record the fan-out itself wrote before a crash is recognised by the raw offset
  (and sub-index) in the headers of its partition's last record (``tails``).

Snapshot reads are not ordered by position (parallel workers interleave), so only
streamed changes move the watermark. ``truncate_outputs`` turns a TRUNCATE into one
tombstone per key live on the table topic before it. ``behind`` names the keys another writer's records
left older than this fan-out's own, and ``newest`` picks, from routes in raw order, each such key's last
record: what it must read as newest again.

A change keyed under another key schema than the records its table topic holds (``int`` made
``bigint``, a numeric key's new scale: the same row, other key bytes) is a ``Rekey``: its own
records, then ``rekey_outputs`` moves every key of the old frame live on the topic before it to
the new frame — a tombstone for the old key and the row under the key re-encoded — so the topic,
compacted, holds each row once and a later delete reaches it. The topic's frame is kept per topic
(``frames``, saved in the checkpoint); a topic it does not know takes its next change's frame.
``rekey_moves`` and ``live_keys`` keep a topic's latest records in scratch maps the caller gives (on
disk in the worker), not in memory.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

from tables.partition import partition_for
from tables.wire import FRAME_SIZE, HEADER_LSN, HEADER_OP, HEADER_POS, HEADER_RAW

STREAMED = frozenset({"INSERT", "UPDATE", "DELETE", "TRUNCATE"})
Position = tuple[int, int]  # (raw offset, sub-index of the record written for it)
Move = tuple[bytes, bytes | None]  # a record a re-key writes: key, row or None (a tombstone)


class Change(NamedTuple):
    """The fields of a raw-topic record the fan-out needs (``tables.change`` schema)."""

    op: str
    schema: str
    table: str
    topic: str
    commit_lsn: int
    position: int
    key: bytes | None
    before: bytes | None
    after: bytes | None
    tx_size: int = 0
    xid: int = 0
    commit_time: Any = None  # a datetime as decoded (timestamp-micros)
    backfill: int | None = None  # the backfill (incremental snapshot) a READ row or retraction belongs to

    @property
    def ends_transaction(self) -> bool:
        """The last change of a transaction — streamed, or a backfill's chunk (READ rows with a ``tx_size``) — or
        the end of the snapshot: a consistent point. Snapshot rows have a ``tx_size`` of 0 and end nothing."""
        return self.op == "SNAPSHOT_END" or (self.tx_size > 0 and self.position == self.tx_size - 1)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Change:
        return cls(record["op"], record["schema"], record["table"], record["topic"], record["commit_lsn"],
                   record["position"], record["key"], record["before"], record["after"],
                   record.get("tx_size", 0), record.get("xid", 0), record.get("commit_time"),
                   record.get("backfill"))  # fmt: skip


class Output(NamedTuple):
    topic: str
    partition: int
    key: bytes | None  # None: a Debezium truncate event
    value: bytes | None
    headers: list[tuple[str, bytes]]


@dataclass(frozen=True)
class Truncate:
    """A TRUNCATE to carry out: tombstone every key live on ``topic`` before raw ``offset``."""

    topic: str
    offset: int
    commit_lsn: int
    position: int


@dataclass(frozen=True)
class Rekey:
    """A change keyed with ``frame`` on a topic whose records had another key frame: its own records
    (``outputs``, for keys ``own``), then every key of another frame live before raw ``offset`` moved to ``frame``."""

    topic: str
    offset: int
    commit_lsn: int
    position: int
    frame: bytes
    outputs: list[Output]
    own: frozenset[bytes]


def headers(op: str, offset: int, sub: int, lsn: int, position: int) -> list[tuple[str, bytes]]:
    return [(HEADER_OP, op.encode()), (HEADER_RAW, b"%d.%d" % (offset, sub)), (HEADER_LSN, b"%d" % lsn),
            (HEADER_POS, b"%d" % position)]  # fmt: skip


def header_position(record_headers: Iterable[tuple[str, bytes | None]] | None) -> Position | None:
    """The ``(raw offset, sub)`` a record was written for, from its ``hw.raw`` header."""
    for name, value in record_headers or ():
        if name == HEADER_RAW and value:
            offset, _, sub = value.decode().partition(".")
            return int(offset), int(sub or 0)
    return None


def header_lsn(record_headers: Iterable[tuple[str, bytes | None]] | None) -> tuple[int, int]:
    """``(commit_lsn, position)`` of the change a table-topic record carries (0, 0 if none)."""
    lsn = position = 0
    for name, value in record_headers or ():
        if name == HEADER_LSN and value:
            lsn = int(value)
        elif name == HEADER_POS and value:
            position = int(value)
    return lsn, position


@dataclass
class Counters:
    changes: int = 0
    written: int = 0
    duplicates: int = 0  # sent twice by capture
    replayed: int = 0  # written already by an earlier run of the fan-out
    skipped: int = 0  # snapshot markers, unkeyed tables
    dead_letters: int = 0


class FanOut:
    """Routes raw changes to table-topic records, remembering what is already written."""

    def __init__(
        self,
        partitions: int,
        watermark: tuple[int, int] = (-1, -1),
        tails: dict[tuple[str, int], Position] | None = None,
        key_of_row: Callable[[bytes, bytes], bytes] | None = None,
        frames: dict[str, bytes] | None = None,
    ) -> None:
        self.partitions = partitions
        self.watermark = watermark  # highest (commit_lsn, position) of a streamed change seen
        self.tails = dict(tails or {})  # (topic, partition) -> position of its last record
        self.key_of_row = key_of_row  # (old full row, new key) -> old key, for REPLICA IDENTITY FULL
        self.counters = Counters()
        self.unkeyed: set[str] = set()
        self.frames = dict(frames or {})  # table topic -> the key frame of its records (``Rekey``)

    def fresh(self, topic: str, partition: int, at: Position) -> bool:
        """True unless the partition already holds the record written for ``at``."""
        tail = self.tails.get((topic, partition))
        if tail is not None and tail >= at:
            self.counters.replayed += 1
            return False
        return True

    def route(self, change: Change, offset: int) -> list[Output] | Truncate | Rekey:
        """The records for one change at raw ``offset`` (empty if none or already written)."""
        self.counters.changes += 1
        if change.op in STREAMED:
            ident = (change.commit_lsn, change.position)
            if ident <= self.watermark:
                self.counters.duplicates += 1
                return []
            self.watermark = ident
        if change.op == "TRUNCATE":
            return Truncate(change.topic, offset, change.commit_lsn, change.position)
        if change.op not in ("READ", "INSERT", "UPDATE", "DELETE") or change.key is None:
            if change.key is None and change.op != "SNAPSHOT_END":
                self.unkeyed.add(f"{change.schema}.{change.table}")
            self.counters.skipped += 1
            return []
        records: list[tuple[bytes, bytes | None]] = []
        old_key = self.old_key(change)
        if old_key is not None:
            records.append((old_key, None))  # the key changed: the old one is gone
        records.append((change.key, None if change.op == "DELETE" else change.after))
        out = []
        for sub, (key, value) in enumerate(records):
            partition = partition_for(key, self.partitions)
            if self.fresh(change.topic, partition, (offset, sub)):
                out.append(Output(change.topic, partition, key, value,
                                  headers(change.op, offset, sub, change.commit_lsn, change.position)))  # fmt: skip
        self.counters.written += len(out)
        was = self.frames.get(change.topic)
        self.frames[change.topic] = change.key[:FRAME_SIZE]
        if was is None or was == change.key[:FRAME_SIZE]:
            return out
        return Rekey(change.topic, offset, change.commit_lsn, change.position, change.key[:FRAME_SIZE], out,
                     frozenset(key for key, _ in records))  # fmt: skip

    def duplicate(self, change: Change) -> bool:
        """A streamed change at or below the watermark: capture sent it twice (``route`` drops it)."""
        return change.op in STREAMED and (change.commit_lsn, change.position) <= self.watermark

    def old_key(self, change: Change) -> bytes | None:
        """The old key of an UPDATE that changed the key, else None."""
        if change.op != "UPDATE" or change.before is None or change.key is None:
            return None
        if change.before[:5] == change.key[:5]:  # an old key (same key schema id)
            old = change.before
        elif self.key_of_row is not None:  # a full old row (REPLICA IDENTITY FULL)
            old = self.key_of_row(change.before, change.key)
        else:
            return None
        return None if old == change.key else old


def live_keys(records: Iterable[tuple[bytes | None, bytes | None, Position | None]], before: int,
              latest: SortedMap) -> Iterator[bytes]:  # fmt: skip
    """Keys whose latest record written for a raw offset below ``before`` is not a tombstone, in key order:
    ``records`` are read into ``latest`` (an empty scratch map) first, then the keys come from it."""
    for key, value, at in records:
        if key is not None and (at is None or at[0] < before):
            latest[key] = b"\0" if value is None else b"\1"
    return (key for key, alive in latest.items() if alive == b"\1")


class SortedMap(Protocol):
    """A bytes map iterated in key order: a whole topic's scratch (rocksdict's ``Rdict`` on disk; a ``SortedDict``)."""

    def __setitem__(self, key: bytes, value: bytes, /) -> None: ...

    def get(self, key: bytes, /) -> Any: ...  # bytes or None

    def items(self) -> Iterable[tuple[Any, Any]]: ...  # (bytes, bytes)


_NONE: Position = (-2, -2)  # the position of a key a map does not hold: below a record's, even one that does not say
_NEW_OF = b"\x01"  # before an old key in a re-key's ``target``: the new key it got (framed keys begin with 0)


def _entry(at: Position, value: bytes | None) -> bytes:
    """A key's last record in the scratch: its position, then 1 and the row, or 0 (a tombstone)."""
    return struct.pack(">qq", *at) + (b"\0" if value is None else b"\1" + value)


def _at(entry: bytes | None) -> Position:
    return _NONE if entry is None else cast(Position, struct.unpack_from(">qq", entry))


def rekey_moves(rekey: Rekey, records: Iterable[tuple[bytes | None, bytes | None, Position | None]],
                reframe: Callable[[bytes], bytes | None], latest: SortedMap, target: SortedMap,
                ) -> tuple[Iterator[Move], int]:  # fmt: skip
    """What moves ``rekey.topic``'s rows keyed under other frames, live before the re-key's raw offset, to its
    frame, in old-key order: a tombstone for each old key, then its row under the key ``reframe`` gives — unless
    that key is the change's own, or its own last record there was written for a later raw offset (a row deleted or
    written under the new key stays so; a key changed and changed back: the tombstone an earlier move wrote for the
    raw offset the old key's row came from, when it took the row away, does not count); of several old keys giving
    one new key, the newest's row. And how many keys ``reframe``
    cannot move (left as they are). ``latest`` and ``target`` are empty scratch maps: each key's last record, and
    each old key's new key and each new key's chosen old key, live there, not in memory (a 1M-row topic's held
    800 MB in dicts); the moves are produced as they are written, after ``records`` were read."""
    for key, value, at in records:
        if key is not None and (at is None or at[0] < rekey.offset):
            latest[key] = _entry(at or (-1, -1), value)
    stuck = 0
    for key, entry in _moved(rekey, latest):
        moved = reframe(key)
        target[_NEW_OF + key] = moved or b""  # asked once: the moves below follow this answer
        if moved is None:
            stuck += 1
        elif moved not in rekey.own and _newer(entry, latest.get(moved)) and _at(target.get(moved)) < _at(entry):
            target[moved] = entry[:16] + key
    return _moves(rekey, latest, target), stuck


def _newer(entry: bytes, new_keys: bytes | None) -> bool:
    """An old key's last record against its new key's: the new key's stands only when written for a later raw
    offset (``rekey_moves``)."""
    return _at(new_keys)[0] <= _at(entry)[0]


def _moved(rekey: Rekey, latest: SortedMap) -> Iterator[tuple[bytes, bytes]]:
    """The keys of other frames live in ``latest``, in key order, with their entries."""
    for key, entry in latest.items():
        if entry[16] == 1 and key[:FRAME_SIZE] != rekey.frame:
            yield key, entry


def _moves(rekey: Rekey, latest: SortedMap, target: SortedMap) -> Iterator[Move]:
    """``rekey_moves``' records, from its scratch maps: each old key's tombstone, then its row under its new key
    when the new key chose it."""
    for key, entry in _moved(rekey, latest):
        moved = target.get(_NEW_OF + key)
        if moved:
            yield key, None
            if (target.get(moved) or b"")[16:] == key:
                yield moved, entry[17:]


def rekey_outputs(fanout: FanOut, rekey: Rekey, moves: Iterable[Move]) -> Iterator[Output]:
    """``moves`` (``rekey_moves``) as records, sub-indexes from 2 in their order, minus those written."""
    for sub, (key, value) in enumerate(moves, 2):
        partition = partition_for(key, fanout.partitions)
        if fanout.fresh(rekey.topic, partition, (rekey.offset, sub)):
            fanout.counters.written += 1
            marks = headers("READ" if value is not None else "DELETE", rekey.offset, sub, rekey.commit_lsn,
                            rekey.position)  # fmt: skip
            yield Output(rekey.topic, partition, key, value, marks)


def truncate_outputs(fanout: FanOut, truncate: Truncate, keys: Iterable[bytes]) -> Iterator[Output]:
    """A tombstone for each of ``keys`` (sub-index = place in the sorted keys), minus those written."""
    for sub, key in enumerate(keys):
        partition = partition_for(key, fanout.partitions)
        if fanout.fresh(truncate.topic, partition, (truncate.offset, sub)):
            fanout.counters.written += 1
            marks = headers("TRUNCATE", truncate.offset, sub, truncate.commit_lsn, truncate.position)
            yield Output(truncate.topic, partition, key, None, marks)


def behind(records: Iterable[tuple[bytes | None, Position | None]], stop: int, since: int) -> dict[bytes, int]:
    """Keys whose last of another writer's ``records`` (in offset order) was written for a raw offset below
    ``stop`` (where this fan-out stands), with the lowest raw offset any of them was written for (``since``,
    where this fan-out started, for a record that does not say). A key whose last one lies at or past ``stop``
    is left: this fan-out writes that change, or a newer one, itself (and a zombie, behind the owner, leaves
    the owner's records alone)."""
    last: dict[bytes, Position | None] = {}
    first: dict[bytes, int] = {}
    for key, at in records:
        if key is not None:
            last[key] = at
            first[key] = min(first.get(key, stop), since if at is None else at[0])
    return {key: first[key] for key, at in last.items() if at is None or at[0] < stop}


def disordered(records: Iterable[tuple[bytes | None, Position | None]], since: int) -> dict[bytes, int]:
    """Keys of ``records`` (in offset order, past the last writer's checkpoint at raw offset ``since``; the first
    may be keyless, the record before them, for its position only) written for an older raw offset than a record
    before them or than ``since`` (every change below it was written before them): another writer's, behind; with
    the lowest raw offset any was written for (``since`` for one that does not say). The last writer's own records
    after its checkpoint are in raw order from ``since`` on: a new owner writes none of them again."""
    top, found = since - 1, dict[bytes, int]()
    for key, at in records:
        if key is not None and (at is None or at[0] < top):
            first = since if at is None else at[0]
            found[key] = min(found.get(key, first), first)
        top = max(top, -1 if at is None else at[0])
    return found


def newest(routed: Iterable[list[Output] | Truncate | Rekey], keys: dict[tuple[str, int], set[bytes]]) -> list[Output]:
    """The last record each of ``keys`` (``(topic, partition)`` -> keys) got from ``routed`` (the routes of
    changes in raw order); a TRUNCATE of the topic makes it a tombstone, until a later change."""
    last: dict[tuple[str, int, bytes], Output] = {}
    for outputs in routed:
        if isinstance(outputs, Rekey):  # its own records; the keys it moved are not followed here
            outputs = outputs.outputs
        if isinstance(outputs, Truncate):
            marks = headers("TRUNCATE", outputs.offset, 0, outputs.commit_lsn, outputs.position)
            for (topic, partition), some in keys.items():
                if topic == outputs.topic:
                    last.update({(topic, partition, k): Output(topic, partition, k, None, marks) for k in some})
            continue
        for o in outputs:
            if o.key is not None and o.key in keys.get((o.topic, o.partition), ()):
                last[(o.topic, o.partition, o.key)] = o
    return list(last.values())
