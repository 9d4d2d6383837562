"""The views' runtime: raw changes in commit order in, view rows and published cuts out.

Promise: ``Materializer.handle`` applies a batch of raw changes to the join state (a
``streams.viewstore`` on disk, committed at least once per batch), in order, dropping changes
capture sent twice (the ``(commit_lsn, position)`` watermark of streamed changes). At the last
*consistent point* of the batch — the end of a transaction or of the snapshot — it
builds every dirty view row and writes those that changed (against what was sent
before) to the view topics — compacted, Avro, keyed by the base row's key, every row
carrying that commit LSN — and to the table the endpoint reads, without waiting. Once
Kafka acknowledged a point's rows (and every earlier point's), a *cut* per view goes
to ``<prefix>.views.cuts``: the commit LSN and each view-topic partition's end, so a
reader who reads the view topic to those ends sees every transaction up to the LSN
whole and none after it. Cuts are published in order by ``streams.cuts``.
Publishing takes at most half of the time: a point that comes sooner after the last
publication than that one took is skipped — its dirty rows wait for a later point (or for the
feed to go idle at one) and are written once, with that point's LSN. So a change that
dirties most of a view (a product's price, under every order holding it) makes the view
publish less often, not fall behind the raw topic.

After a crash the state is as of the last batch committed — or, on a worker that takes the
views over without state of its own, empty, and the raw topic is replayed from its start.
The view topics are the record of what was published: on (re)start they are read back,
and every view row whose document, built from the recovered rows, differs from its
latest record is dirty. Replay starts at the saved progress, re-applies changes
(idempotent), and publishes nothing until it is past the last raw offset whose writes
the state may hold (``@high``, written before each batch) and at or past the newest
commit LSN the view topics hold (their records can outlive the state writes of the same
batch), so no half-replayed state is ever published and a row's LSN never goes back.
A row that did not change is not written again: a replay adds nothing
to the view topics' latest state.

The jobs are split: ``streams.viewtopic`` makes the views' topics and schemas,
``streams.publisher`` knows what the view topics hold and writes the rows that changed,
``streams.cuts`` publishes cuts in order on its own thread (stopped by ``close``); this module
applies batches, chooses the points to publish, and recovers. Only the views' feed thread calls
``resume``, ``handle`` and ``idle``; the endpoint reads ``row`` and ``describe``.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Sequence
from typing import Any

import fastavro
from confluent_kafka import Producer

from streams import clients
from streams.config import StreamsConfig
from streams.cursor import Cursor, Raw
from streams.cuts import Cuts, Frames
from streams.docbytes import Encoders
from streams.fanout import STREAMED, Change
from streams.joins import Joiner
from streams.metrics import StreamsMetrics, clock
from streams.publisher import Publisher
from streams.viewstore import MemoryViewStore
from streams.viewtopic import ViewTopic
from streams.writer import TableWriter
from tables.registry import Registry
from tables.views import CUT_SCHEMA, TableShape
from tables.wire import UndecodableMessage, frame, lsn_text

log = logging.getLogger("headwater.streams")
HIGH = b"@high"  # no state write comes from a raw offset above this one
PROGRESS = b"@progress"  # replay starts here: (raw offset, watermark) after the last published cut
PROGRESS_FORMAT = struct.Struct(">qqi")
COMMIT_EVERY = 10_000  # view rows written between commits of the endpoint's copies
TABLES_KEY = b"@tables"  # the tables whose rows the state keeps (a view on a new table replays from the start)
KEY_STRING = fastavro.parse_schema("string")


class Materializer:
    """Keeps the views: join state, dirty rows, publication at consistent points, cuts."""

    def __init__(self, cfg: StreamsConfig, views: dict[str, ViewTopic], shapes: dict[str, TableShape],
                 store: MemoryViewStore, writer: TableWriter, schemas: Registry,
                 metrics: StreamsMetrics | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        self.metrics = metrics or StreamsMetrics()
        self.unpublished = False  # the state holds changes the last cut does not (streams.metrics.CutWatch)
        self.views = views
        self.shapes = shapes
        self.store = store
        self.writer = writer  # for topics and reading back
        self.schemas = schemas
        # its own producer: its deliveries drive the cuts; a short linger, rows wait for nothing else
        producer = Producer(clients.producer_settings(cfg))
        self.cuts = Cuts(producer, cfg.cuts_topic, {n: v.topic for n, v in views.items()}, self._cut_frames)
        self.publisher = Publisher(cfg, views, store, self.cuts)
        self.encoders = {name: Encoders(view.schema) for name, view in views.items()}
        self.joiner: Joiner | None = None
        self.cursor = Cursor(cfg.changes_topic, "views", lambda: writer.low_watermark(cfg.changes_topic))
        self.watermark = (-1, -1)
        self.quiet_until = -1  # replaying: publish nothing at points below this raw offset
        self.frames: Frames | None = None  # cut value and key frames
        self.next_publish = 0.0  # monotonic time from which the next point may be published
        self.at_point: tuple[int, int] | None = None  # (raw offset, commit LSN) the state is consistent at
        self.stats = {"changes": 0, "batches": 0, "points": 0, "rows": 0, "busy_s": 0.0}
        self.reported = time.monotonic()

    # ---- start-up -----------------------------------------------------------------------
    def load(self) -> Joiner:
        """(Re)build the join state from the recovered table and the view topics; replay from the progress."""
        self.store.open()
        saved = self.store.get(PROGRESS)
        start, lsn, position = PROGRESS_FORMAT.unpack(saved) if saved else (0, -1, -1)
        self.joiner = joiner = Joiner([v.spec for v in self.views.values()], self.shapes, self.store,
                                      self.schemas.decode, encoders=self.encoders)  # fmt: skip
        high = self.store.get(HIGH)
        self.quiet_until = int.from_bytes(high, "big", signed=True) if high else -1
        kept = set(json.loads(self.store.get(TABLES_KEY) or b"[]"))
        if saved and not joiner.tables <= kept:
            start, lsn, position = self._from_the_start(joiner.tables - kept)
        self.store[TABLES_KEY] = json.dumps(sorted(joiner.tables | kept)).encode()
        self.cursor.reset(start)
        self.watermark = (lsn, position)
        for name, view in self.views.items():
            sent = self.publisher.read_back(view)
            joiner.dirty[name] = set()
            for key in {*joiner.base_keys(name), *sent}:
                changed, content = self.publisher.changed(joiner, view, key)
                if changed:
                    joiner.dirty[name].add(key)
                else:
                    self.publisher.mend(view, key, content)
        dirty = sum(len(d) for d in joiner.dirty.values())
        log.info("views %s resume at raw offset %d (quiet until offset %d and commit LSN %s, %d rows to publish "
                 "again)", ", ".join(self.views), start, self.quiet_until,
                 lsn_text(max(self.publisher.published_lsn, 0)), dirty)  # fmt: skip
        self.store.commit()
        return joiner

    def _from_the_start(self, new: set[str]) -> tuple[int, int, int]:
        """A view uses tables whose rows were not kept: replay the raw topic from its first offset."""
        low = self.writer.low_watermark(self.cfg.changes_topic)
        log.warning("the views now use %s, whose rows were not kept: replaying %s from offset %d",
                    ", ".join(sorted(new)), self.cfg.changes_topic, low)  # fmt: skip
        if low > 0:
            log.error("%s starts at offset %d (retention): rows of %s changed before it are missing until they "
                      "change again; re-snapshot with a new capture slot to rebuild them", self.cfg.changes_topic,
                      low, ", ".join(sorted(new)))  # fmt: skip
        return low, -1, -1

    def resume(self) -> int:
        """Rebuild the join state as recovered (after a rebalance): the raw offset to read next."""
        self.load()
        return self.cursor.next

    # ---- changes ------------------------------------------------------------------------
    def handle(self, batch: Sequence[Raw]) -> None:
        """Apply a batch of (raw offset, key, value); publish at its last consistent point; commit the state."""
        joiner = self.joiner or self.load()
        started = clock()
        rows = self.stats["rows"]
        changes = self._admit(batch)
        if not changes:
            return
        self.store[HIGH] = changes[-1][0].to_bytes(8, "big", signed=True)  # before any write of the batch
        points = [i for i, (offset, c) in enumerate(changes) if c.ends_transaction and self._may_publish(offset, c)]
        last = points[-1] if points else -1
        for _, change in changes[: last + 1]:
            joiner.apply(change)
        self.store.commit()  # scans and the store's memory stay small while the point is published
        if last >= 0 and self._due():
            self.publish(changes[last][0], changes[last][1].commit_lsn)
        for _, change in changes[last + 1 :]:
            joiner.apply(change)
        self.store.commit()
        ends = last == len(changes) - 1  # the state is at a consistent point: idle() may publish it
        self.at_point = (changes[-1][0], changes[-1][1].commit_lsn) if ends else None
        self.stats["changes"] += len(changes)
        self.stats["batches"] += 1
        self.stats["busy_s"] += self.metrics.spent("views", started)
        self.metrics.applied(len(changes), int(self.stats["rows"] - rows))
        self.unpublished = joiner.waiting() or bool(self.cuts.pending)
        self.report(batch[-1][0])

    def _due(self) -> bool:
        """Whether a point may be published now: publishing takes at most half the time (the dirty rows
        of the points skipped meanwhile are published at a later one, each once)."""
        return time.monotonic() >= self.next_publish

    def idle(self) -> None:
        """Nothing new to read: publish what waits, if the state is at a consistent point and it is time."""
        if self.at_point is not None and self.joiner is not None and self._due():
            if self.joiner.waiting():
                rows, started = self.stats["rows"], clock()
                self.publish(*self.at_point)
                self.store.commit()
                self.metrics.applied(0, int(self.stats["rows"] - rows))
                self.stats["busy_s"] += self.metrics.spent("views", started)
            self.at_point = None
        self.unpublished = (self.joiner is not None and self.joiner.waiting()) or bool(self.cuts.pending)

    def replaying(self) -> int | None:
        """The raw offset a replay after a restart must pass before anything is published, while below it."""
        return self.quiet_until if self.joiner is not None and self.cursor.next < self.quiet_until else None

    def _may_publish(self, offset: int, change: Change) -> bool:
        """Past what a crashed run may have half applied (``@high``) and what it published (newest LSN)."""
        return offset >= self.quiet_until and change.commit_lsn >= self.publisher.published_lsn

    def _admit(self, batch: Sequence[Raw]) -> list[tuple[int, Change]]:
        """The batch's new, decodable, not-yet-seen changes (the fan-out dead-letters the rest)."""
        out = []
        for offset, _, value in self.cursor.admit(batch):
            if value is None:
                continue
            try:
                change = Change.from_record(self.schemas.decode(value))
            except (UndecodableMessage, KeyError, TypeError):
                continue
            if change.op in STREAMED:
                ident = (change.commit_lsn, change.position)
                if ident <= self.watermark:
                    continue  # capture sent it twice
                self.watermark = ident
            out.append((offset, change))
        return out

    # ---- publication --------------------------------------------------------------------
    def publish(self, offset: int, lsn: int) -> None:
        """Write the changed view rows as of ``lsn`` (not waiting); their cut follows once Kafka has them."""
        assert self.joiner is not None
        started = time.monotonic()
        self.joiner.expand()
        for name, view in self.views.items():
            for n, key in enumerate(sorted(self.joiner.dirty[name]), 1):
                self.stats["rows"] += self.publisher.write(self.joiner, view, key, lsn)
                if n % COMMIT_EVERY == 0:  # a snapshot's end publishes every row: its copies go in parts
                    self.store.commit()
            self.joiner.dirty[name].clear()
        self.cuts.point(lsn)
        self.store[PROGRESS] = PROGRESS_FORMAT.pack(offset + 1, *self.watermark)
        self.stats["points"] += 1
        ended = time.monotonic()
        self.next_publish = ended + (ended - started)

    def _cut_frames(self) -> Frames:
        """The cut schemas' frames (registered on the poller thread, when the first cut is due)."""
        if self.frames is None:
            registry = Registry(self.cfg.registry_url, setting="registry_url in [pipeline] or [streams]")
            self.frames = (frame(registry.register(f"{self.cfg.cuts_topic}-value", CUT_SCHEMA)),
                           frame(registry.register(f"{self.cfg.cuts_topic}-key", {"type": "string"})))  # fmt: skip
        return self.frames

    # ---- reading ------------------------------------------------------------------------
    def report(self, offset: int, every: float = 10.0) -> None:
        """A progress line every ``every`` seconds: changes, batches, points published, rows written."""
        now = time.monotonic()
        if now - self.reported < every:
            return
        s, span = self.stats, now - self.reported
        log.info("views at raw offset %d: %.0f changes/s in %d batches, %d points published, %d rows written "
                 "(%.0f%% busy); last cut %s", offset, s["changes"] / span, s["batches"], s["points"], s["rows"],
                 100 * s["busy_s"] / span, self._cut_text())  # fmt: skip
        self.stats = dict.fromkeys(self.stats, 0)
        self.reported = now

    def row(self, view: str, key: bytes) -> tuple[int, dict[str, Any]] | None:
        """(commit LSN, document) of a view row as last published, or None."""
        return self.publisher.row(view, key)

    def _cut_text(self) -> str:
        cut = self.cuts.last()
        return "none" if cut is None else lsn_text(cut)

    def close(self) -> None:
        """Stop publishing cuts (the poller thread ends; the next run publishes what is left)."""
        self.cuts.close()

    def describe(self) -> dict[str, Any]:
        cut = self.cuts.last()
        return {"cut_lsn": None if cut is None else lsn_text(cut), "rows_published": self.publisher.published,
                "views": [{"name": v.spec.name, "base": v.spec.base, "topic": v.topic, "key": v.key_columns,
                           "joins": [j.path for j in v.spec.joins]} for v in self.views.values()]}  # fmt: skip
