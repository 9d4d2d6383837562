"""Backfills (incremental snapshots), the pure part: requests, chunk windows, progress.

Promise: no I/O. A backfill copies one table (or the rows of it a predicate picks) into
the raw topic while the stream goes on, by the DBLog algorithm: the table is read in
chunks ordered by its key, each chunk between a low and a high watermark written into
the WAL. ``Window`` holds one chunk's rows from its read until its high watermark comes
through the stream; every streamed change to one of its keys committed between the
watermarks drops that row (the stream carries the key's newer state — or its deletion —
so the chunk's row must not overwrite it), a TRUNCATE of the table drops them all, and
what is left is written at the high watermark, as one transaction. The stream may change
keys before the chunk's rows are in (they are read while the stream goes on). ``suspects``
finds the one race the watermarks cannot see: a transaction streamed before the low
watermark whose change the chunk's read could not see yet (its commit record was written,
its commit not yet visible); the keys it changed (``Touch``, kept by ``Recent``) leave the
chunk too — a row without key cannot be matched, so then the chunk is read again.
``parse_signal`` reads a row of the
signal table (Debezium's layout and signal names), ``check_predicate`` refuses a
``--where`` predicate that could reach past its parentheses, and ``Backfill`` holds one
backfill's progress (rows, rate, ETA) for the log, ``headwater status`` and metrics.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tables.wire import FRAME_SIZE

Table = tuple[str, str]  # (schema, name)
Row = tuple[bytes | None, bytes | None]  # (key image, value image) as capture writes them
WATERMARK_PREFIX = "headwater.backfill"  # pg_logical_emit_message prefix of the watermarks
ACTIONS = ("snapshot", "pause", "resume", "cancel")
UNFINISHED = ("queued", "running", "paused")
SIGNALS = {"execute-snapshot": "snapshot", "pause-snapshot": "pause", "resume-snapshot": "resume",
           "stop-snapshot": "cancel"}  # fmt: skip


class SignalError(ValueError):
    """A request or signal that cannot be carried out; the message says what to fix."""


# ---- requests ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """What a user asked for: snapshot these tables (optionally only rows matching ``predicate``), or pause,
    resume or cancel the backfills of these tables (all when none are named)."""

    action: str
    tables: tuple[str, ...] = ()
    predicate: str | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise SignalError(f"unknown action {self.action!r}; one of {', '.join(ACTIONS)}")
        if self.action == "snapshot" and not self.tables:
            raise SignalError("name at least one table to snapshot")
        if self.predicate is not None and self.action != "snapshot":
            raise SignalError("a predicate (where) goes with a snapshot only")


def parse_signal(kind: str | None, data: str | None) -> Request:
    """A signal-table row (``type``, ``data``) as a request, the way Debezium's signal table reads:
    ``execute-snapshot`` with ``{"data-collections": [...], "additional-conditions": [{"data-collection":
    ..., "filter": ...}]}`` (or a plain ``"filter"``), ``pause-snapshot``, ``resume-snapshot``,
    ``stop-snapshot`` (``data-collections`` optional)."""
    action = SIGNALS.get((kind or "").strip())
    if action is None:
        raise SignalError(f"unknown signal type {kind!r}; one of {', '.join(SIGNALS)}")
    try:
        payload = json.loads(data) if data and data.strip() else {}
    except json.JSONDecodeError as exc:
        raise SignalError(f"the signal's data is not JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise SignalError("the signal's data must be a JSON object")
    if payload.get("type", "incremental") != "incremental":
        raise SignalError(f"only incremental snapshots are supported, not {payload.get('type')!r}")
    tables = payload.get("data-collections") or []
    if not isinstance(tables, list) or not all(isinstance(t, str) for t in tables):
        raise SignalError('"data-collections" must be a list of table names')
    return Request(action, tuple(tables), _filter(payload, tables))


def _filter(payload: Mapping[str, Any], tables: list[str]) -> str | None:
    """One predicate for the request: ``filter``, or the one ``additional-conditions`` gives every table."""
    conditions = [c for c in payload.get("additional-conditions") or () if isinstance(c, dict)]
    filters = {c.get("filter") for c in conditions} | {payload.get("filter")}
    filters.discard(None)
    if len(filters) > 1:
        raise SignalError("give one filter for all the tables of a signal (send one signal per filter)")
    named = {c.get("data-collection") for c in conditions} - {None}
    if named and named != set(tables):
        raise SignalError('"additional-conditions" must name exactly the tables of "data-collections"')
    return str(filters.pop()) if filters else None


def qualify(name: str) -> Table:
    """``schema.table`` or ``table`` (public) as (schema, table); quotes around either part are taken off."""
    parts = [p.strip().strip('"') for p in name.strip().split(".")]
    if len(parts) == 1 and parts[0]:
        return "public", parts[0]
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1]
    raise SignalError(f"{name!r} is not a table name (schema.table or table)")


_QUOTED = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|\$(\w*)\$.*?\$\1\$", re.DOTALL)


def check_predicate(text: str) -> str:
    """The predicate, stripped, if it stays inside ``WHERE (...)``: no ``;``, no comments, parentheses
    balanced outside quotes. Else ``SignalError``: capture runs it with its own privileges."""
    predicate = text.strip()
    if not predicate:
        raise SignalError("the predicate (where) is empty")
    bare = _QUOTED.sub(" _ ", predicate)  # quoted text and names: their content is not SQL
    if re.search(r"'|\"|\$\w*\$", bare):
        raise SignalError("the predicate has an unterminated quote")
    if ";" in bare or "--" in bare or "/*" in bare:
        raise SignalError("the predicate must be one SQL expression: no ';' and no comments")
    depth = 0
    for ch in bare:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth != 0:
        raise SignalError("the predicate's parentheses do not balance")
    return predicate


# ---- windows -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """What a chunk's read could see (``pg_current_snapshot()``), as 32-bit xids (pgoutput's)."""

    xmin: int
    xmax: int
    xip: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        xmin, xmax, xip = text.split(":")
        return cls(int(xmin) & MASK, int(xmax) & MASK, frozenset(int(x) & MASK for x in xip.split(",") if x))

    def invisible(self, xid: int) -> bool:
        """The transaction had not committed, or its commit was not visible yet, when the chunk was read."""
        return xid in self.xip or follows_or_equals(xid, self.xmax)


MASK = 0xFFFFFFFF


def follows_or_equals(a: int, b: int) -> bool:
    """``a >= b`` for 32-bit xids, modulo wraparound (PostgreSQL's TransactionIdFollowsOrEquals)."""
    return ((a - b) & MASK) < 0x80000000


KeyOf = Callable[[bytes], bytes | None]  # a full old row (REPLICA IDENTITY FULL) -> its key image


@dataclass
class Touch:
    """What streamed changes did to the table being backfilled: the keys they changed (as framed, old keys of moved
    rows included), whether one truncated it, whether one changed a row without key."""

    keys: set[bytes] = field(default_factory=set)
    truncated: bool = False
    unkeyed: bool = False

    def add(self, op: str, key: bytes | None, before: bytes | None, framed: bool, old_key: KeyOf) -> None:
        """One change. ``framed``: images in the Confluent wire format (Avro), where an old key image shows
        by its schema id; else (JSON) an old image is always a full row, its key taken by ``old_key``."""
        if op == "TRUNCATE":
            self.truncated = True
            return
        if key is None:
            self.unkeyed = True
            return
        self.keys.add(key)
        if op == "UPDATE" and before is not None:
            old = before if framed and before[:FRAME_SIZE] == key[:FRAME_SIZE] else old_key(before)
            if old is not None:
                self.keys.add(old)

    def merge(self, other: Touch) -> None:
        self.keys |= other.keys
        self.truncated |= other.truncated
        self.unkeyed |= other.unkeyed


class Recent:
    """The commits (up to ``limit``) that changed the table being backfilled since the last chunk written, in
    stream order: each one's xid, place in the stream (``seq``) and what it changed."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self.seq = 0
        self.xids: dict[int, tuple[int, Touch]] = {}
        self.full = False  # a commit was forgotten for the limit: one still invisible may go unseen

    def commit(self, xid: int, touch: Touch | None) -> None:
        self.seq += 1
        if touch is not None:
            self.xids[xid] = (self.seq, touch)
            if len(self.xids) > self.limit:
                del self.xids[next(iter(self.xids))]
                self.full = True

    def prune(self, seq: int, snapshot: Snapshot) -> None:
        """A chunk whose low watermark came at ``seq`` was written: forget the commits streamed before it that its
        read (``snapshot``) saw — every later read, with a newer snapshot, sees them too. Those it could not see
        stay: they may still be invisible to the next read (a commit waiting for a synchronous standby)."""
        self.xids = {xid: found for xid, found in self.xids.items() if found[0] >= seq or snapshot.invisible(xid)}


def suspects(recent: Recent, low_seq: int, snapshot: Snapshot) -> list[Touch]:
    """What the transactions streamed before the low watermark that the chunk's read could not see changed (their
    commit record was written, their commit not yet visible). The stream wrote those changes before the chunk,
    so the chunk's rows of those keys are older than the topic's: drop them too (a truncate: every row; a row
    without key cannot be matched: read the chunk again)."""
    return [touch for xid, (seq, touch) in recent.xids.items() if seq < low_seq and snapshot.invisible(xid)]


def vouches(watched_from: int | None, recent: Recent, snapshot: Snapshot) -> bool:
    """Whether a chunk read with ``snapshot`` shows that the keys it read were in the table after every change the
    stream carried before them (so a later delete of one is on the stream, after the chunk): every transaction
    given an xid before the table was watched (below ``watched_from``, an xid taken then; None: deletes or
    truncates are not all published) had ended when it was read, and ``recent`` forgot no commit since
    (``suspects`` drops the rows of those it holds)."""
    return watched_from is not None and follows_or_equals(snapshot.xmin, watched_from) and not recent.full


class Window:
    """One chunk between its watermarks: the rows (or, for a retraction, the keys) read, minus every key the
    stream changed between the watermarks (``touch``); rows without key are kept as they are. Keys are compared as
    framed; where a key's schema id is not the touched keys' (a key column's type changed: int made bigint keeps
    the bytes, a numeric's scale changes what they mean), by the values ``values`` decodes. The stream may change
    keys before the rows are there (``fill``): a chunk is read while the stream goes on, and its rows are
    due only at its high watermark, written after the read."""

    def __init__(self, backfill: int, table: Table, token: str, op: str, rows: Iterable[Row],
                 values: Callable[[bytes], list[Any]] | None, *, framed: bool = True) -> None:  # fmt: skip
        self.backfill, self.table, self.token, self.op, self.values = backfill, table, token, op, values
        self.framed = framed  # images in the Confluent wire format (Avro): an old key shows by its schema id
        self.rows: list[Row] = []
        self.read = 0
        self.touch = Touch()  # what the stream changed inside the window
        self.opened = False  # the low watermark came through the stream
        self.low_seq = 0
        self.read_keys = 0  # a retraction: the keys it checked
        self.upper: list[str | None] | None = None  # where the next chunk starts (key texts, or the page)
        self.last = False  # no chunk after this one
        self.large: list[tuple[bytes, int, str]] = []  # (key body, column, text) of TOASTable values read
        self.fill(rows)

    def fill(self, rows: Iterable[Row]) -> None:
        """The rows read (in the order read; a key appears once)."""
        self.rows = list(rows)
        self.read = len(self.rows)

    def see(self, op: str, key: bytes | None, before: bytes | None, old_key: KeyOf) -> None:
        """A streamed change to the table, committed inside the window."""
        self.touch.add(op, key, before, self.framed, old_key)

    def result(self) -> list[Row]:
        """What is left to write at the high watermark: every row read unless the stream changed its key (a
        truncate of the table: none)."""
        if self.touch.truncated:
            return []
        touched = self.touch.keys
        first = next((key for key, _ in self.rows if key is not None), None)
        if not touched or first is None:
            return self.rows
        kept = [row for row in self.rows if row[0] not in touched]
        if not self.framed or self.values is None or not kept:
            return kept
        return self._by_value(kept, touched)

    def _by_value(self, rows: list[Row], touched: set[bytes]) -> list[Row]:
        """``rows`` less those whose key has the values of a touched key of another schema id (a row framed as
        every touched key is, was compared by its bytes; only the others are decoded)."""
        assert self.values is not None
        values, frames = self.values, {key[:FRAME_SIZE] for key in touched}
        only = next(iter(frames)) if len(frames) == 1 else None
        gone: set[Any] | None = None
        kept = []
        for row in rows:
            if row[0] is None or (only is not None and row[0].startswith(only)):
                kept.append(row)
                continue
            gone = {hashable(values(key)) for key in touched} if gone is None else gone
            if hashable(values(row[0])) not in gone:
                kept.append(row)
        return kept


def hashable(value: Any) -> Any:
    """A decoded key's values as a set can hold them (lists made tuples, an interval's record its items)."""
    if isinstance(value, list):
        return tuple(hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, hashable(v)) for k, v in value.items())
    return value


# ---- progress ------------------------------------------------------------------------------
@dataclass
class Backfill:
    """One backfill: what it copies, where it is, and its progress (persisted in capture's state)."""

    id: int
    table: str  # schema.table
    predicate: str | None = None
    origin: str = "request"  # "new table", "request" (headwater snapshot), "signal" (the signal table)
    status: str = "queued"  # queued, running, paused, done, cancelled, failed
    phase: str = "chunks"  # chunks (reading the table), retract (tombstones for keys the table no longer has)
    cursor: list[str | None] | None = None  # the last key (or page) written and acknowledged; None: the start
    upto: list[str | None] | None = None  # the largest key (or page) when it started: later rows are streamed
    rows: int = 0
    estimate: int = 0
    retracted: int = 0
    message: str = ""
    dropped: int = 0  # rows read that the stream changed before their chunk's high watermark (left to it)
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    keys_end: int | None = None  # the raw topic's end as its chunks began: its retraction reads keys below it
    # (None: not known yet, no chunk to read, or saved by an earlier version: the keys are read to the end then)
    vouched: bool | None = None  # every chunk written so far vouched for its keys (``vouches``): after a restart the
    # keys of its rows on the raw topic need no look-up (None: not begun, or saved by an earlier version)
    since: tuple[float, int] = field(default=(0.0, 0), compare=False)  # (monotonic time, rows) of this run's start

    @property
    def qualified(self) -> Table:
        schema, _, name = self.table.partition(".")
        return schema, name

    def begin(self, now: float | None = None) -> None:
        """This process starts (or resumes) working on it: the rate counts from here."""
        self.since = (time.monotonic() if now is None else now, self.rows)

    def rate(self, now: float | None = None) -> float:
        then, rows = self.since
        elapsed = (time.monotonic() if now is None else now) - then
        return (self.rows - rows) / elapsed if then and elapsed > 0 else 0.0

    def eta(self, rate: float) -> float | None:
        """Seconds left at ``rate`` rows/s (None: unknown)."""
        if self.status != "running" or rate <= 0:
            return None
        return max(self.estimate - self.rows, 0) / rate

    def describe(self, rate: float | None = None) -> str:
        """One line: table, status, rows, rate, ETA, where it came from (``rate``: this process's, unless given)."""
        rate = self.rate() if rate is None else rate
        where = f" where {self.predicate}" if self.predicate else ""
        parts = [f"#{self.id} {self.table}{where}: {self.status}"]
        if self.status == "done":
            parts.append(f"{self.rows} rows")  # the estimate was PostgreSQL's guess: the count is known now
        elif self.rows or self.status == "running":
            parts.append(f"{self.rows}/~{max(self.estimate, self.rows)} rows")
        if self.status == "running":
            eta = self.eta(rate)
            parts.append(f"{rate:.0f} rows/s" + (f", ETA {eta:.0f} s" if eta is not None else ""))
            if self.phase == "retract":
                parts.append("retracting keys the table no longer holds")
        if self.dropped:
            parts.append(f"{self.dropped} read rows left to the stream (changed meanwhile)")
        if self.status == "done" and self.started_at and self.finished_at:
            parts.append(f"in {self.finished_at - self.started_at:.1f} s, {self.retracted} keys retracted")
        return ", ".join(parts) + f" ({self.origin})" + (f": {self.message}" if self.message else "")


@dataclass(frozen=True)
class Progress:
    """One backfill's numbers, read by the log, ``headwater status`` and (later) metrics."""

    id: int
    table: str
    status: str
    phase: str
    rows: int
    estimate: int
    rate: float
    eta: float | None
    retracted: int

    @classmethod
    def of(cls, backfill: Backfill, now: float | None = None) -> Progress:
        b, rate = backfill, backfill.rate(now)
        return cls(b.id, b.table, b.status, b.phase, b.rows, b.estimate, rate, b.eta(rate), b.retracted)
