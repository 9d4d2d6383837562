"""Backfills at run time: which tables to backfill, their chunks between watermarks, requests and progress.

Promise: a table that joins the captured set — newly matched by ``include`` at start, or
added to the publication while capture runs (its first Relation message, or a look at the
publication every few seconds) — is backfilled; so is any captured table ``headwater
snapshot`` (through capture's state) or a row of the signal table (through the stream)
asks for, optionally narrowed by a predicate. One backfill runs at a time, in the order
asked. Its chunks are read by a thread of their own (``capture.chunker.Reader``: low
watermark, the next chunk by key, high watermark) while the stream goes on in capture's
thread, up to ``AHEAD`` chunks in flight; the stream hands the reader the next chunk when it
has a moment (``step``), or as soon as the last one's high watermark comes through. Every
commit streamed inside a chunk's window drops its rows whose keys it changed
(``capture.backfill.Window``); at the high watermark's commit the rest is sent as one
transaction of READ rows before anything after it (``ChangeSink.emit_chunk``: through a
producer driven from C, which from the first chunk on carries the stream's messages too,
so order holds without waiting for Kafka). A chunk that cannot be sent (its backfill
cancelled, a row without key it may hold too old) drops the chunks read after it: they are
read again from the backfill's cursor. Once the table is read, the
keys the raw topic held for it before the backfill (read in a thread, ``capture.retract``, up to the
topic's end found before its first chunk is read and saved with it, so a restart reads to the same end)
that the table no longer holds get DELETEs (keys a chunk read and vouches for are not looked up), checked
between watermarks too. A chunk's
progress is saved in capture's state once Kafka acknowledged it, so after a crash the
backfill goes on after the last acknowledged chunk (a chunk written twice is harmless:
its rows are read again, after newer watermarks). Pause, resume and cancel take effect at
the next chunk. ``progress()`` is every backfill's numbers (rows, rate, ETA), logged every
few seconds and saved for ``headwater status``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import psycopg2

from capture import catalog, chunker, retract
from capture.backfill import (
    UNFINISHED,
    Backfill,
    KeyOf,
    Progress,
    Recent,
    Request,
    Row,
    SignalError,
    Table,
    Touch,
    Window,
    check_predicate,
    parse_signal,
    qualify,
    suspects,
    vouches,
)
from capture.catalog import TableRef, TypeCache
from capture.changes import ChangeSink, TxBuffer
from capture.config import CaptureConfig
from capture.decoder import Commit, Relation
from capture.encoder import RowEncoder
from capture.errors import UnsupportedValueError
from capture.schemas import register_table
from capture.state import Mailbox, State
from capture.transcoder import copier_spec
from tables.registry import NoRegistry, Registry
from tables.wire import avro_body, body, frame

log = logging.getLogger("headwater.capture")
POLL_EVERY = 5.0  # seconds between looks at the publication for tables added to it
AHEAD = 3  # chunks in flight at once (read, or being read): what a backfill holds in memory
JOB_END_WAIT = 5.0  # seconds to wait for the reader's job to end once its high watermark came through
LOG_EVERY = 5.0  # seconds between progress lines
RETRY_AFTER = 5.0  # seconds between reads of the raw topic's keys after one failed
EARLY_KEYS = 2_000_000  # keys of chunks read before the raw topic's keys are known, kept (~50 bytes each) to leave out
PUBLISH_PASSES = 2  # passes over the keys read leaving out early chunks' keys before the stream is handed the rest


class Streaming(Protocol):
    """What a ``Backfiller`` needs of the streamer (``capture.stream.Streamer``)."""

    keyed: dict[tuple[str, str], bool]
    watch: Any
    backfills: Any


@dataclasses.dataclass(frozen=True)
class Plan:
    """What reading one backfill's table needs; made when it starts, and again after its shape changed."""

    reading: chunker.Reading
    old_key: KeyOf  # a full old row (REPLICA IDENTITY FULL) -> its key image
    decode: retract.KeyDecoder  # a key image -> the key's values (retractions)


@dataclasses.dataclass
class Flight:
    """A chunk (or retraction batch) on its way: its window on the stream, the reader's job, the plan it is
    read with (its encoder writes it, whatever happens to the backfill's plan meanwhile)."""

    window: Window
    job: chunker.Job
    plan: Plan
    abandoned: bool = False


def _no_old_key(before: bytes) -> bytes | None:
    return None


def _raise(exc: BaseException) -> bool:
    raise exc


class Candidates:
    """The keys the raw topic holds alive for one table, read in a thread while the chunks are read: the
    keys a retraction checks once the table is read. A key a chunk read (``read_in``, for the chunks that
    ``capture.backfill.vouches`` for) is not checked: its row was in the table after every change the stream
    carried before it, so the stream carries any later delete of it. (Asking
    PostgreSQL cost ~9 us a key: 34k keys took 0.3 s of a 1.5 s backfill, bench/RESULTS.md, 2026-11-28.)
    Keys are compared as framed: a key written under another key schema id is looked up, because the same body
    may mean another value under another schema (``numeric(10,2)`` made ``numeric(10,3)``: the bytes of 1.50 are
    those of 0.150), and a key taken as read by mistake would never be retracted. The keys are those below
    ``end``: the raw topic's end when the backfill started, found first when not given (``woken`` is called then) — the
    backfill's own chunks, written after it, are not candidates (reading to the end found later made the
    first 2-4 chunks' 16,384 keys each candidates, and after a restart every chunk written before it: 606k
    look-ups, 7.5 s, bench/RESULTS.md, 2026-11-28)."""

    def __init__(self, cfg: CaptureConfig, table: Table, what: str, end: int | None = None,
                 woken: Callable[[], None] = lambda: None, *, reads: Callable[[], bool] | None = None) -> None:
        self.cfg, self.table, self.what = cfg, table, what
        self.end, self.woken = end, woken
        self.reads = reads  # whether the READ rows of the table past ``end`` are its own, their chunks vouched for
        # (asked once the end is pinned: every row below the topic's end then was written after its chunk was judged)
        self.keys: list[bytes] | None = None
        self.error: BaseException | None = None
        self.failed_at = 0.0  # when the read failed (monotonic): read again RETRY_AFTER later
        self.done = 0  # keys checked
        self.handed = 0  # keys handed to a read (checked once its high watermark comes through)
        self.held: set[bytes] | None = None  # ``keys`` as a set, made when a chunk's keys are first marked
        self.read: set[bytes] = set()  # those of the keys a chunk read
        self.early: list[list[bytes]] = []  # the keys of chunks read before the keys were known
        self.early_count = 0
        self.left_out = 0  # keys left out before they were handed to the stream (``_publish``)
        self.marked_early = 0  # keys of chunks read before that the stream found among them (``_marked``)
        self.lock = threading.Lock()  # ``keys`` and ``early`` between this read's thread and the stream's
        self.told = False  # the keys left to look for were counted (and logged)
        self.stop = threading.Event()  # the session ends, or the backfill: stop reading
        self.thread = threading.Thread(target=self._read, name=f"backfill-keys-{table[1]}", daemon=True)

    def start(self) -> Candidates:
        self.thread.start()
        return self

    def _read(self) -> None:
        registry = Registry(self.cfg.registry_url) if self.cfg.format == "avro" else None
        try:
            removed_to = self._pin()
            if self.stop.is_set():
                return
            self.woken()
            reads = self.reads is not None and removed_to is not None and self.reads()
            live = retract.earlier_keys(self.cfg, [self.table], registry, self.what, stop=self.stop,
                                        end=self.end, removed_to=removed_to, reads=reads)  # fmt: skip
            if self.stop.is_set():
                return  # keys left None: a stopped read never hands out an empty set
            if live is not None and reads:
                self._keep_written(live.taken[self.table])
            self._publish(list(live.keys[self.table]) if live is not None else [])
            self.woken()
        except Exception as exc:  # reported by batch(), which reads again
            self.failed_at = time.monotonic()
            self.error = exc  # after failed_at: the stream reads them in this order
        finally:
            if registry is not None:
                registry.close()

    def _keep_written(self, taken: int) -> None:
        """The keys of the rows its chunks wrote before a restart (on the raw topic past ``end``), held as they are
        framed, were taken out by the read (``taken``). (Without that, a re-snapshot of 1M rows killed after
        311k-410k rows looked up 321k-420k keys after its restart, ~9 us each, and the rest took 19-21 s instead of
        12 s; bench/RESULTS.md, 2026-11-29.)"""
        with self.lock:
            self.left_out += taken
        log.info("%s: %d of the keys the raw topic holds for %s.%s were read by the chunks it wrote before it was"
                 " restarted: no look-up", self.what, taken, *self.table)  # fmt: skip

    def _pin(self) -> int | None:
        """The end to read keys below (``end``); given (a restart), the topic's end now, up to which the keys' deletes
        are read too: the retraction's DELETEs written before the restart lie past ``end``."""
        now = retract.raw_end(self.cfg, missing_ok=False)  # capture wrote it: missing is a broker not answering
        if self.end is None:
            self.end = now
            return None
        if now < self.end:
            log.warning("%s: the raw topic %s ends at %d, below the %d it had when the backfill started (it lost"
                        " messages): reading the keys it holds now", self.what, self.cfg.changes_topic, now,
                        self.end)  # fmt: skip
            self.end = now
        return now

    def batch(self, gone: Callable[[bytes], bool]) -> tuple[int, list[bytes]] | None:
        """The next keys to check, handed out once: (how many, those of them the stream did not delete
        meanwhile — their tombstone is on the topic already); (0, []) when all are handed out, None while
        they are being read. (The high watermark of a read can come through before the reader's job is
        taken, and ``step`` then asks for the next batch before the read is closed: handing out from
        ``done`` sent that batch's DELETEs twice.)"""
        if self.keys is None:
            return None
        if not self.told:  # the first batch: the keys chunks read are left out
            self._marked()
            held, early, self.told = len(self.keys) + self.left_out, self.left_out + self.marked_early, True
            if self.read:
                self.keys = [k for k in self.keys if k not in self.read]
            self.read, self.held = set(), None
            log.info("%s: %d of the %d keys the raw topic holds for %s.%s were read by its chunks (%d of them before"
                     " the keys were known); looking for the other %d in the table", self.what, held - len(self.keys),
                     held, *self.table, early, len(self.keys))  # fmt: skip
        keys = self.keys[self.handed : self.handed + retract.BATCH]
        self.handed += len(keys)
        return len(keys), [k for k in keys if not gone(k)]

    def _publish(self, keys: list[bytes]) -> None:
        """The keys read, handed to the stream less those of the chunks read meanwhile (``read_in``): they are left
        out here, in this thread, while the stream goes on (for 1M keys ~0.3 s a pass). After ``PUBLISH_PASSES``
        the keys are handed over anyway (chunks may close faster than a pass takes): the stream leaves out those
        of chunks read meanwhile (``_marked``), as it does for chunks read afterwards."""
        for _ in range(PUBLISH_PASSES):
            if self.stop.is_set():
                return  # keys left None, as a stopped read leaves them
            with self.lock:
                early = self._early()
                if not early:
                    self.keys = keys
                    return
            held, keys = len(keys), self._unread(keys, early)
            self.left_out += held - len(keys)
        with self.lock:
            self.keys = keys

    def read_in(self, rows: list[Row]) -> None:
        """A chunk's rows as read (before the stream's changes dropped any): their keys need no check. Rows read
        before the keys are known are kept (their keys, ``EARLY_KEYS`` at most in all) for ``_publish``; rows read
        once the keys are being handed out change nothing: their keys are checked. (Without the early ones, a
        re-snapshot of a 1M-row table whose topic held its 1M keys looked every one up: the chunks were done in
        ~3 s, the keys' read in 6-12 s, and 1M look-ups took 11-12 s more, bench/RESULTS.md, 2026-11-28.)"""
        if self.told:
            return
        keys = [key for key, _ in rows if key is not None]
        with self.lock:
            if self.keys is None:
                self._keep(keys)
                return
        self._marked()
        self._mark(keys, self.keys)

    def _keep(self, keys: list[bytes]) -> None:
        if keys and self.early_count + len(keys) <= EARLY_KEYS:
            self.early.append(keys)
        elif keys and self.early_count <= EARLY_KEYS:
            log.info("%s: more than %d keys of %s.%s read before the raw topic's keys are known: the keys of chunks"
                     " read from now until they are known are looked for in the table", self.what, EARLY_KEYS,
                     *self.table)  # fmt: skip
        self.early_count += len(keys)  # never reset: EARLY_KEYS bounds what is ever kept

    def _marked(self) -> None:
        """Chunks ``_publish`` left in ``early`` (the stream's thread alone touches it once the keys are known)."""
        assert self.keys is not None
        before = len(self.read)
        for early in self._early():
            self._mark(early, self.keys)
        self.marked_early += len(self.read) - before  # read before the keys were known, too

    @staticmethod
    def _unread(keys: list[bytes], chunks: list[list[bytes]]) -> list[bytes]:
        """``keys`` less those of ``chunks`` (as framed: for 1M keys ~0.3 s)."""
        read = set().union(*chunks)
        return [k for k in keys if k not in read] if read else keys

    def _early(self) -> list[list[bytes]]:
        early, self.early = self.early, []
        return early

    def _mark(self, keys: list[bytes], candidates: list[bytes]) -> None:
        """Those of ``keys`` (a chunk's) that are among ``candidates`` (the keys, as a set in ``held``) are read."""
        if not keys:
            return
        if self.held is None:
            self.held = set(candidates)
        self.read.update(self.held.intersection(keys))

    def rewind(self) -> None:
        """The read of the keys handed out was abandoned: they are handed out again."""
        self.handed = self.done


class Backfiller:
    """Backfills of one capture session (see the module's promise); the stream's ``BackfillHooks``."""

    def __init__(self, cfg: CaptureConfig, dsn: str, state: State, sink: ChangeSink,
                 registrar: Registry | NoRegistry, streamer: Streaming) -> None:  # fmt: skip
        self.cfg, self.state, self.sink, self.registrar, self.streamer = cfg, state, sink, registrar, streamer
        self.dsn = dsn
        self._conn: catalog.Connection | None = None
        self._types: TypeCache | None = None
        self._fast: bool | None = None
        self.framed = cfg.format == "avro"
        self.backfills: dict[int, Backfill] = {}  # unfinished, in the order asked
        self.plans: dict[int, Plan] = {}
        self.candidates: dict[int, Candidates] = {}
        self.reader = chunker.Reader(dsn)
        self.flights: dict[str, Flight] = {}  # chunks read or being read, waiting for their high watermark, in order
        self.job: Flight | None = None  # the one the reader is reading
        self.ahead: tuple[int, chunker.Bound | None, bool] | None = None  # (backfill, next chunk's start, all read)
        self.old_key: KeyOf = _no_old_key
        self.watching: Table | None = None
        self.recent = Recent()
        self.gone: set[bytes] = set()  # keys of the watched table the stream deleted (their tombstone is written)
        self.watched_from: int | None = None  # the next xid when the table was watched (``backfill.vouches``)
        self.pending: deque[tuple[int, Backfill]] = deque()  # (end LSN, progress) to save once Kafka has it
        self.last_end = 0
        self.ignored: set[Table] = set()  # relations seen that are not captured
        self.failures: dict[int, int] = {}  # reads refused in a row, per backfill
        self.session, self.tokens = secrets.token_hex(6), 0
        self.signal_at = (0, -1)
        self.applied = state.signal_position()
        self.polled = self.logged = time.monotonic()
        self.mailbox = Mailbox(cfg.state_dir, cfg.slot)  # last: nothing after it can fail and leave it open
        streamer.backfills = self

    def close(self) -> None:
        for candidates in self.candidates.values():
            candidates.stop.set()
        self.reader.close()
        if self._conn is not None:
            self._conn.close()
        self.mailbox.close()

    @property
    def conn(self) -> catalog.Connection:
        """The backfills' own connection (autocommit), made when first needed: streaming starts without it."""
        if self._conn is None or self._conn.closed:
            conn = catalog.connect(self.dsn)
            conn.autocommit = True
            self._conn, self._types = conn, None
        return self._conn

    @property
    def types(self) -> TypeCache:
        if self._types is None:
            self._types = TypeCache(self.conn)
        return self._types

    @property
    def fast(self) -> bool:
        """Rows through the compiled Copier: Avro on a UTF8 server."""
        if self._fast is None:
            self._fast = self.framed and catalog.server_utf8(self.conn)
        return self._fast

    # ---- start ---------------------------------------------------------------------------
    def start(self, tables: list[TableRef], fresh: bool) -> None:
        """The session's captured ``tables``: those that were not captured before are backfilled (``fresh``: a
        snapshot just copied them all); unfinished backfills go on."""
        names = {t.qualified for t in tables}
        with self.state.db:
            known = self.state.captured()
            if not fresh and not known:
                log.info("capture's state names no captured tables yet: recording %d (tables that join them later"
                         " are backfilled)", len(names))  # fmt: skip
                self.state.capture(add=names)
            elif not fresh:
                self.state.capture(remove=known - names)
                for name in sorted(names - known):
                    self._queue_new(name, "newly matched by include, or newly published")
        for backfill in self.state.backfills(unfinished=True):
            self.backfills[backfill.id] = backfill
            if backfill.qualified not in self.streamer.keyed:
                self._end(backfill, "cancelled", "the table is no longer captured")
            elif backfill.status != "queued":
                log.info("backfill %s: going on", backfill.describe())

    def _queue_new(self, name: str, why: str) -> Backfill:
        """A table captured from now on (``why``): record it, and backfill the rows it already holds."""
        self.state.capture(add=[name])
        backfill = self.state.add_backfill(name, None, "new table")
        self.backfills[backfill.id] = backfill
        log.info("%s is captured from now on (%s): backfill #%d copies the rows it holds", name, why, backfill.id)
        return backfill

    # ---- the stream's hooks ----------------------------------------------------------------
    def relation(self, rel: Relation) -> None:
        table = (rel.namespace, rel.name)
        if table in self.streamer.keyed or table in self.ignored or table == self.cfg.signal:
            return
        self._join(table, "its first change came through the stream")

    def _join(self, table: Table, how: str) -> None:
        """A table the publication publishes and capture did not capture: captured from now on if it matches."""
        ref = catalog.table_ref(self.conn, *table)
        if ref is None or not self.cfg.wants(*table):
            self.ignored.add(table)
            return
        if not ref.keyed and not self.cfg.allow_unkeyed:
            log.warning("%s is published but has no primary key or replica identity index: not captured (set "
                        "allow_unkeyed to capture it without)", ref.qualified)  # fmt: skip
            self.ignored.add(table)
            return
        with self.state.db:
            self._queue_new(ref.qualified, how)
        self.streamer.keyed[table] = ref.keyed

    def signal(self, values: dict[str, str | None], lsn: int) -> None:
        at = (lsn, self.signal_at[1] + 1 if lsn == self.signal_at[0] else 0)  # the n-th signal of its commit
        self.signal_at = at
        if at <= self.applied:
            return  # applied before a restart, streamed again from the last confirmed commit
        kind, data = values.get("type"), values.get("data")
        request: Request | None = None
        with self.state.db:
            try:
                request = parse_signal(kind, data)
                outcome = self.apply(request, "signal")
            except SignalError as exc:
                outcome = f"refused: {exc}"
            self.state.signal_applied(*at)
        self.applied = at
        if request is not None:
            self.mailbox.request(request.action, request.tables, request.predicate, "signal", outcome)
        else:
            self.mailbox.request(str(kind), (), data, "signal", outcome)
        say = log.error if outcome.startswith("refused") else log.info
        say("signal %s (%s): %s", values.get("id"), kind, outcome)

    def commit(self, changes: TxBuffer, xid: int, marks: list[bytes], commit: Commit) -> None:
        table, touch = self.watching, None
        if table is not None:
            schema, name = table
            for c in changes:
                if c.table == name and c.schema == schema:
                    touch = touch or Touch()
                    touch.add(c.op, c.key, c.before, self.framed, self.old_key)
                    if c.op == "DELETE" and c.key is not None:
                        self.gone.add(c.key)  # as framed, as the candidates are compared
        if touch is not None:
            for flight in self.flights.values():
                if flight.window.opened:
                    flight.window.touch.merge(touch)
        self.recent.commit(xid, touch)
        for mark in marks:
            self._watermark(mark, commit, xid)

    def _watermark(self, content: bytes, commit: Commit, xid: int) -> None:
        found = chunker.parse_watermark(content)
        flight = self.flights.get(found[1]) if found is not None else None
        if found is None or flight is None:
            return  # another session's, or a chunk abandoned
        if found[0] == "low":
            flight.window.opened, flight.window.low_seq = True, self.recent.seq
            return
        del self.flights[flight.window.token]  # written after the read handed its rows over (``Job.ready``)
        if flight is self.job:  # the reader wrote it last: its job ends now; the next read starts before this sends
            flight.job.ended.wait(JOB_END_WAIT)
            self.step()
        if not (flight.window.opened and flight.job.ready and self._close(flight, commit, xid)):
            self._abandon(flight.window.backfill)

    def _close(self, flight: Flight, commit: Commit, xid: int) -> bool:
        """The high watermark of ``flight`` came through: send what is left of its chunk, before what follows
        (False: nothing sent — the chunks after it must be read again, from the backfill's cursor)."""
        window, job = flight.window, flight.job
        backfill = self.backfills.get(window.backfill)
        if backfill is None or backfill.status not in ("running", "paused"):
            return False
        assert job.snapshot is not None
        late = suspects(self.recent, window.low_seq, job.snapshot)
        if any(touch.unkeyed for touch in late):
            log.info("backfill #%d: a change to a row without key the chunk's read could not see yet came through"
                     " before its low watermark: reading the chunk again", backfill.id)  # fmt: skip
            return False
        for touch in late:
            window.touch.merge(touch)
        self.recent.prune(window.low_seq, job.snapshot)
        self.failures.pop(backfill.id, None)
        self._fill(window, job.result)
        if window.op == "READ":
            self._vouch(backfill, window, vouches(self.watched_from, self.recent, job.snapshot))
        rows = window.result()
        sent = self.sink.emit_chunk(window.op, flight.plan.reading.encoder.table, rows, commit.commit_lsn, xid,
                                    commit.commit_time, backfill.id)  # fmt: skip
        if window.op == "READ":
            self._remember(backfill, window, rows, commit.commit_lsn)
            backfill.rows += sent
            backfill.dropped += window.read - sent
            backfill.cursor = window.upper
            backfill.phase = "retract" if window.last else "chunks"
        else:
            backfill.retracted += sent
            self.candidates[backfill.id].done += window.read_keys
        self.last_end = commit.end_lsn
        self.pending.append((self.last_end, dataclasses.replace(backfill)))
        return True

    def _vouch(self, backfill: Backfill, window: Window, vouched: bool) -> None:
        """The keys of a chunk that vouches need no check; one that does not is saved at once, before its rows are
        written (a restart then looks up the keys of every row the backfill wrote before it)."""
        candidates = self.candidates.get(backfill.id)
        if vouched and candidates is not None:
            candidates.read_in(window.rows)
        elif not vouched and backfill.vouched:
            backfill.vouched = False
            self.state.unvouch(backfill.id)

    @staticmethod
    def _fill(window: Window, result: Any) -> None:
        """A job's result into its window: a chunk, or the keys a retraction found missing."""
        if isinstance(result, chunker.Chunk):
            window.fill(result.rows)
            window.upper, window.last, window.large = result.upper, result.last, result.large
        else:
            window.fill((key, None) for key in result)

    def _abandon(self, backfill: int) -> None:
        """Drop the chunks of ``backfill`` in flight: the next is read from its cursor (the last chunk sent)."""
        for token in [t for t, f in self.flights.items() if f.window.backfill == backfill]:
            self.flights.pop(token).abandoned = True
        if self.job is not None and self.job.window.backfill == backfill:
            self.job.abandoned = True
        if self.ahead is not None and self.ahead[0] == backfill:
            self.ahead = None
        if (candidates := self.candidates.get(backfill)) is not None:
            candidates.rewind()

    def _remember(self, backfill: Backfill, window: Window, rows: list[tuple[bytes | None, bytes | None]],
                  lsn: int) -> None:  # fmt: skip
        """The TOASTable values of the rows sent, for later updates that leave them unchanged."""
        if not window.large:
            return
        sent = {body(key) for key, _ in rows if key is not None}
        for key, column, text in window.large:
            if key in sent:
                self.state.remember(backfill.table, key, column, lsn, text)

    # ---- chunks ----------------------------------------------------------------------------
    def waker(self) -> int:
        return self.reader.wake

    def step(self) -> bool:
        took = self._take()
        if self.job is not None or len(self.flights) >= AHEAD:
            return took
        backfill = self._next()
        if backfill is None:
            if not self.flights:
                self.streamer.watch = self.watching = None
            return took
        return self._guarded(backfill, lambda: self._advance(backfill)) or took

    def _take(self) -> bool:
        """The reader's job, once it ended: where the next chunk starts, or its error handled (True if one
        ended)."""
        self.reader.drain()
        flight = self.job
        if flight is None or not flight.job.done:
            return False
        self.job = None
        window, job = flight.window, flight.job
        backfill = self.backfills.get(window.backfill)
        if flight.abandoned or backfill is None:
            return True  # its result is not wanted any more (its high watermark, if written, is ignored)
        if job.error is not None:
            error = job.error
            self._abandon(backfill.id)
            self._guarded(backfill, lambda: _raise(error))
        elif isinstance(job.result, chunker.Chunk):
            self.ahead = (backfill.id, job.result.upper, job.result.last)
        return True

    def _guarded(self, backfill: Backfill, work: Callable[[], bool]) -> bool:
        """``work`` for ``backfill``, with what its reads may raise handled (a lost connection ends the
        session); True unless ``work`` said there was nothing to do."""
        try:
            return work()
        except chunker.ShapeChanged:
            log.info("backfill #%d: the columns of %s changed: registering its new shape", backfill.id, backfill.table)
            self.plans.pop(backfill.id, None)
        except (SignalError, UnsupportedValueError) as exc:
            self._end(backfill, "failed", str(exc))
        except psycopg2.Error as exc:
            if catalog.connection_lost(exc):
                raise
            self._failed_read(backfill, exc)
        return True

    def _next(self) -> Backfill | None:
        """The backfill to read for: the one whose chunks are in flight while it runs, else ``_current``."""
        if self.flights:
            owner = self.backfills.get(next(iter(self.flights.values())).window.backfill)
            return owner if owner is not None and owner.status == "running" else None
        return self._current()

    def _failed_read(self, backfill: Backfill, exc: psycopg2.Error) -> None:
        """A read PostgreSQL refused: once, with the table's shape and types read again (a DDL may have raced
        it), then the backfill fails with PostgreSQL's message."""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        self.failures[backfill.id] = self.failures.get(backfill.id, 0) + 1
        if self.failures[backfill.id] > 1:
            self._end(backfill, "failed", text)
            return
        log.warning("backfill #%d: reading %s failed (%s): trying once more", backfill.id, backfill.table, text)
        self.plans.pop(backfill.id, None)
        self.types.types.clear()

    def _current(self) -> Backfill | None:
        """The backfill to work on: the first running, else the first queued (started now)."""
        running = [b for b in self.backfills.values() if b.status == "running"]
        if running:
            return running[0]
        queued = next((b for b in self.backfills.values() if b.status == "queued"), None)
        if queued is not None:
            self._guarded(queued, lambda: self._start(queued))  # a table dropped since it was asked: it fails
        return queued if queued is not None and queued.status == "running" else None

    def _start(self, backfill: Backfill) -> bool:
        plan = self._plan(backfill)
        self.sink.producer.settle()  # every change streamed so far lies below the raw topic's end found now
        self._candidates(backfill)  # found while the table's bounds are read
        ks = plan.reading.ks
        backfill.estimate = chunker.validate(self.conn, ks.table, backfill.predicate)
        backfill.upto = chunker.last_bound(self.conn, ks, backfill.predicate)
        backfill.status, backfill.started_at = "running", time.time()
        backfill.phase = "chunks" if backfill.upto is not None else "retract"
        with self.state.db:
            self.state.save_backfill(backfill)
        key = ", ".join(ks.key) or "heap pages (no key)"
        log.info("backfill #%d of %s started (%s): ~%d rows, in chunks of %d by %s", backfill.id, backfill.table,
                 backfill.origin, backfill.estimate, self.cfg.backfill_chunk_rows, key)  # fmt: skip
        self.failures.pop(backfill.id, None)  # a read refused while it started was tried once more
        return True

    def _advance(self, backfill: Backfill) -> bool:
        """Hand the reader the next chunk (or retraction batch) of ``backfill``; False if there is none to read
        now (the raw topic's end not known yet, every chunk read and in flight, or its keys still being read)."""
        if backfill.phase == "chunks" and not self._pinned(backfill):
            return False
        plan = self._ready(backfill)
        if backfill.phase == "chunks":
            if self.ahead is None or self.ahead[0] != backfill.id:
                self.ahead = (backfill.id, backfill.cursor, False)
            if self.ahead[2]:
                return False
            self._read_chunk(backfill, plan, self.ahead[1])
            return True
        if self.flights:
            return False
        candidates = self._candidates(backfill)
        batch = candidates.batch(self.gone.__contains__)
        if batch is None:
            return False
        if not batch[0]:
            if candidates.done < candidates.handed:
                return False  # the last keys' read is closed first
            self._end(backfill, "done")
        elif not batch[1]:
            candidates.done += batch[0]
        else:
            self._read_missing(backfill, plan, batch[1]).read_keys = batch[0]
        return True

    def _ready(self, backfill: Backfill) -> Plan:
        """Its plan, the raw topic's keys being read, the stream watching its table, its rate counting."""
        plan = self._plan(backfill)
        self._candidates(backfill)
        if self.watching != backfill.qualified:
            self.watching, self.recent, self.gone = backfill.qualified, Recent(), set()
            self.watched_from = chunker.watch_start(self.conn, self.cfg.publication, plan.reading.ks.table)
        self.old_key = plan.old_key
        self.streamer.watch = self
        if not backfill.since[0]:
            backfill.begin()
        return plan

    def _pinned(self, backfill: Backfill) -> bool:
        """Whether the raw topic's end its retraction reads to is known (and saved): chunks are read after it."""
        if backfill.keys_end is None:
            backfill.keys_end = self._candidates(backfill).end
            if backfill.keys_end is None:
                return False
            backfill.vouched = True  # its chunks begin at this end (rows an earlier version wrote lie below it)
            with self.state.db:  # nothing of this session was read yet: what is saved is what was acknowledged
                self.state.save_backfill(backfill)
        return True

    def _candidates(self, backfill: Backfill) -> Candidates:
        found = self.candidates.get(backfill.id)
        if found is not None and found.error is not None and time.monotonic() - found.failed_at < RETRY_AFTER:
            return found  # still failed: read again a little later, not at every step
        if found is None or found.error is not None:
            if found is not None:
                log.error("backfill #%d: reading the raw topic's keys of %s failed (%s): reading them again",
                          backfill.id, backfill.table, found.error)  # fmt: skip
            failed = found
            found = self.candidates[backfill.id] = Candidates(
                self.cfg, backfill.qualified, f"backfill #{backfill.id}", backfill.keys_end, self.reader.poke,
                reads=self._own_rows(backfill))  # fmt: skip
            if failed is not None:  # what its chunks read stays true
                found.early, found.early_count = failed.early, failed.early_count
            found.start()
        return found

    def _own_rows(self, backfill: Backfill) -> Callable[[], bool] | None:
        """Whether every chunk ``backfill`` wrote vouched and no other backfill of its table wrote rows since it began
        (one paused meanwhile may have), asked again once the keys' read pinned its end: the READ rows of the table
        past its ``keys_end`` are its own then (None: they may not be, already)."""
        if not backfill.vouched or backfill.started_at is None or self._others(backfill, self.state.backfills(
                table=backfill.table)):  # fmt: skip
            return None
        return lambda: backfill.vouched is True and not self._others(backfill, list(self.backfills.values()))

    @staticmethod
    def _others(backfill: Backfill, found: list[Backfill]) -> bool:
        """Whether another of ``found`` of the same table began and was not done before ``backfill`` began."""
        return any(other.id != backfill.id and other.table == backfill.table and other.started_at is not None
                   and (other.finished_at is None or other.finished_at > (backfill.started_at or 0))
                   for other in found)  # fmt: skip

    def _stop_reading(self, backfill: int) -> None:
        found = self.candidates.pop(backfill, None)
        if found is not None:
            found.stop.set()

    def _submit(self, backfill: Backfill, plan: Plan, op: str, read: Callable[[catalog.Connection, TypeCache], Any]
                ) -> Window:  # fmt: skip
        """A read between watermarks for the reader; its window sees the stream from its low watermark on."""
        self.tokens += 1
        token = f"{self.session}:{self.tokens}"
        window = Window(backfill.id, backfill.qualified, token, op, (), plan.decode, framed=self.framed)
        flight = self.job = self.flights[token] = Flight(window, chunker.Job(token, read), plan)
        self.reader.submit(flight.job)
        return window

    def _read_chunk(self, backfill: Backfill, plan: Plan, after: chunker.Bound | None) -> Window:
        upto, predicate, ref, prefix = backfill.upto, backfill.predicate, plan.reading.ks.table, self.cfg.topic_prefix
        assert upto is not None

        def read(conn: catalog.Connection, types: TypeCache) -> chunker.Chunk:
            shape = lambda: catalog.table_schema(conn, types, prefix, ref)  # noqa: E731 - read in the chunk's transaction
            return plan.reading.read(conn, predicate, after, upto, shape)

        return self._submit(backfill, plan, "READ", read)

    def _read_missing(self, backfill: Backfill, plan: Plan, keys: list[bytes]) -> Window:
        shape = plan.reading.encoder.table
        return self._submit(backfill, plan, "DELETE", lambda conn, _: chunker.missing(conn, shape, keys, plan.decode))

    def _plan(self, backfill: Backfill) -> Plan:
        found = self.plans.get(backfill.id)
        if found is not None:
            return found
        ref = catalog.table_ref(self.conn, *backfill.qualified)
        if ref is None:
            raise SignalError(f"{backfill.table} no longer exists")
        shape = catalog.table_schema(self.conn, self.types, self.cfg.topic_prefix, ref)
        ids = register_table(self.registrar, shape, self.cfg)
        self.sink.writer.learn(shape, ids)
        encoder = RowEncoder(shape, ids.value, ids.key, self.cfg.format)
        spec = copier_spec(encoder) if self.fast else None
        old_key, decode = self._codecs(encoder, ids.key)
        ks = chunker.keyset(self.conn, ref, shape)
        reading = chunker.Reading(ks, encoder, spec, self.cfg.backfill_chunk_rows, decode)
        plan = self.plans[backfill.id] = Plan(reading, old_key, decode)
        return plan

    def _codecs(self, encoder: RowEncoder, key_id: int | None) -> tuple[KeyOf, retract.KeyDecoder]:
        """How keys of this table are taken from an old full row, and decoded."""
        shape = encoder.table
        names = [shape.columns[i].name for i in shape.key_indexes]
        if self.cfg.format == "json" or not isinstance(self.registrar, Registry) or key_id is None:
            return _json_old_key(names), retract.json_keys(shape)
        registry, key_schema = self.registrar, self.registrar.parsed(key_id)

        def old_key(before: bytes) -> bytes | None:
            row = registry.decode(before)
            return frame(key_id) + avro_body(key_schema, {n: row[n] for n in names}) if names else None

        return old_key, retract.avro_keys(shape, registry.schema)

    # ---- ends ------------------------------------------------------------------------------
    def _end(self, backfill: Backfill, status: str, message: str = "") -> None:
        """Done, failed or cancelled: saved once Kafka acknowledged what it sent (at once for the others). Done waits
        for Kafka to acknowledge its last chunk (sent without waiting), so its time is the whole backfill's."""
        if status == "done":
            self.sink.producer.settle()  # as long as a message may take: not 60 s, then a BrokerError
        backfill.status, backfill.message, backfill.finished_at = status, message, time.time()
        self.backfills.pop(backfill.id, None)
        self.plans.pop(backfill.id, None)
        self._stop_reading(backfill.id)
        self._abandon(backfill.id)
        if status == "done":
            if not self.backfills:
                self.sink.producer.unroute()  # just flushed: the stream may go back to its own producer
            self.pending.append((self.last_end, dataclasses.replace(backfill)))
            elapsed = backfill.finished_at - (backfill.started_at or backfill.finished_at)
            log.info("backfill #%d of %s done: %d rows in %.2f s, %d keys the table no longer holds retracted",
                     backfill.id, backfill.table, backfill.rows, elapsed, backfill.retracted)  # fmt: skip
            return
        with self.state.db:
            self.state.save_backfill(backfill)
        (log.error if status == "failed" else log.info)("backfill #%d of %s %s%s", backfill.id, backfill.table,
                                                         status, f": {message}" if message else "")  # fmt: skip

    # ---- housekeeping ----------------------------------------------------------------------
    def housekeeping(self, acked_lsn: int | None) -> None:
        self._save(acked_lsn)
        self._requests()
        now = time.monotonic()
        if now - self.polled >= POLL_EVERY:
            self.polled = now
            for table in sorted(catalog.published(self.conn, self.cfg.publication) - set(self.streamer.keyed)
                                - self.ignored - {self.cfg.signal}):  # fmt: skip
                self._join(table, f"added to publication {self.cfg.publication}")
        if now - self.logged >= LOG_EVERY:
            self.logged = now
            for backfill in self.backfills.values():
                if backfill.status == "running":
                    log.info("backfill %s", backfill.describe())

    def _save(self, acked_lsn: int | None) -> None:
        """Save the progress Kafka acknowledged (a chunk's high watermark at or below ``acked_lsn``)."""
        while self.pending and (self.pending[0][0] == 0 or (acked_lsn is not None and self.pending[0][0] <= acked_lsn)):
            _, saved = self.pending.popleft()
            live = self.backfills.get(saved.id)
            if live is not None and live.status == "paused" and saved.status == "running":
                saved.status = "paused"
            if live is None and saved.status != "done":
                continue  # cancelled or failed meanwhile: saved then
            with self.state.db:
                self.state.save_backfill(saved, live.rate() if live is not None else 0.0)

    def _requests(self) -> None:
        """Requests ``headwater snapshot`` left in capture's state."""
        for rid, request in self.mailbox.pending_requests():
            with self.state.db:
                try:
                    if isinstance(request, str):
                        raise SignalError(request)
                    outcome = self.apply(request, "request")
                except SignalError as exc:
                    outcome = f"refused: {exc}"
            self.mailbox.handled(rid, outcome)  # after the backfills it queued are saved: never lost, once twice
            say = log.error if outcome.startswith("refused") else log.info
            say("request %d: %s", rid, outcome)

    # ---- requests --------------------------------------------------------------------------
    def apply(self, request: Request, origin: str) -> str:
        """Carry out a request (inside the caller's ``with state.db``); returns what was done, or raises
        ``SignalError`` saying why nothing was."""
        if request.action == "snapshot":
            return self._snapshot(request, origin)
        targets = self._targets(request.tables)
        change = {"pause": self._pause, "resume": self._resume, "cancel": self._cancel}[request.action]
        done = [b for b in targets if change(b)]
        if not done:
            raise SignalError(f"no backfill to {request.action}" + (f" of {', '.join(request.tables)}"
                                                                     if request.tables else ""))  # fmt: skip
        for backfill in done:
            self.state.save_backfill(backfill)
        return f"{request.action}: " + ", ".join(f"#{b.id} {b.table}" for b in done)

    def _targets(self, names: tuple[str, ...]) -> list[Backfill]:
        tables = {".".join(qualify(n)) for n in names}
        return [b for b in self.backfills.values() if not tables or b.table in tables]

    def _pause(self, backfill: Backfill) -> bool:
        if backfill.status not in ("queued", "running"):
            return False
        backfill.status = "paused"
        return True

    def _resume(self, backfill: Backfill) -> bool:
        if backfill.status != "paused":
            return False
        backfill.status = "running" if backfill.started_at else "queued"
        backfill.begin()
        return True

    def _cancel(self, backfill: Backfill) -> bool:
        if backfill.status not in UNFINISHED:
            return False
        backfill.status, backfill.finished_at = "cancelled", time.time()
        self.backfills.pop(backfill.id, None)
        self.plans.pop(backfill.id, None)
        self._stop_reading(backfill.id)
        self._abandon(backfill.id)
        return True

    def _snapshot(self, request: Request, origin: str) -> str:
        predicate = check_predicate(request.predicate) if request.predicate is not None else None
        refs = [self._captured(name) for name in request.tables]
        for ref in refs:
            chunker.validate(self.conn, ref, predicate)
        queued = []
        for ref in refs:
            backfill = self.state.add_backfill(ref.qualified, predicate, origin)
            self.backfills[backfill.id] = backfill
            queued.append(f"#{backfill.id} {ref.qualified}")
        return "queued backfill " + ", ".join(queued) + (f" where {predicate}" if predicate else "")

    def _captured(self, name: str) -> TableRef:
        """The captured table ``name``, or ``SignalError`` saying why it cannot be backfilled."""
        table = qualify(name)
        ref = catalog.table_ref(self.conn, *table)
        if ref is None:
            raise SignalError(f"there is no table {'.'.join(table)} in this database")
        if table not in self.streamer.keyed and not ref.keyed and not self.cfg.allow_unkeyed:
            raise SignalError(f"{ref.qualified} has no primary key or replica identity index: a backfill reads a"
                              " table in chunks by its key, and drops the rows the stream changed meanwhile by key;"
                              " add a primary key, or set allow_unkeyed to capture and backfill it without"
                              " one")  # fmt: skip
        if table not in self.streamer.keyed:
            raise SignalError(f"{ref.qualified} is not captured (include/exclude patterns, or the publication "
                              f"{self.cfg.publication} does not publish it)")  # fmt: skip
        return ref

    # ---- numbers ---------------------------------------------------------------------------
    def progress(self) -> list[Progress]:
        """Every unfinished backfill's numbers: the one place the log, status and metrics read them from."""
        now = time.monotonic()
        return [Progress.of(b, now) for b in self.backfills.values()]


def _json_old_key(names: list[str]) -> KeyOf:
    def old_key(before: bytes) -> bytes | None:
        row = json.loads(before)
        return json.dumps({n: row.get(n) for n in names}, separators=(",", ":"), ensure_ascii=False).encode()

    return old_key
