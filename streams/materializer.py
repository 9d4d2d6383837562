"""The views on one worker: raw changes in commit order in, the rows of its view partitions out, at agreed points.

Promise: every worker that holds view partitions runs one (``streams.engine``). ``handle`` takes a
batch of raw changes and of points records (``streams.frontier``) and applies the changes to the
join state (``streams.joins``: the split tables' rows of the partitions this worker holds, the
replicated tables whole, in a ``streams.viewstore`` on disk), in order, dropping changes capture
sent twice (the ``(commit_lsn, position)`` watermark of streamed changes), and never past the
barrier the points records set. At every point they ask for — the same consistent point on every
worker — it builds every dirty view row of its partitions and writes those that changed (against
what was sent before) to the view topics, keyed by the base row's key, every row carrying that
commit LSN, and to the endpoint's copies, without waiting; once Kafka acknowledged them its
fragment of the cuts goes to ``<prefix>.views.cuts.fragments`` (and, on the raw partition's
owner, to its ``streams.leader.Assembler`` in memory), and a view's cut follows once every
partition has one at that point. How often points come is the owner's decision
(``streams.frontier.Pace``): publishing takes at most about half the time, so a change that
dirties most of a view is written once per publication, not per change. A worker that resumed
publishes once as soon as it is caught up, asked or not (``streams.frontier.Points.owe``): the
point the others published while it was away may lie before the points records it reads back,
and the pace waits for every part of the last point before it asks for the next.

Each space — a partition's share of the split tables, and the replicated tables — has its own
progress (``@applied``: the raw offset its state reflects and the watermark there), committed in
the same atomic write as its state, so after any crash each space is exactly at its progress.
The reader starts at the lowest; a space applies only changes past its own progress. Nothing is
published until the reader has passed the highest progress (a space that is behind — a
partition taken back, or one this worker never held and rebuilds from the start of the raw
topic — replays quietly while the others skip what they hold), and no partition at a point older
than the newest commit LSN its view records carry: no half-replayed state is ever published and
no row goes back.

The view topics are the record of what was published: when a partition is taken — at start or
at a rebalance (``assign``, then the feed's next ``resume``) — its records are read back and
every row of it is checked at the next publication: written only where its content, built from
the state, differs from its latest record. A row that did not change is not written again: a
replay adds nothing to the view topics. A partition given up is forgotten in memory; its state
stays on disk, and resumes from its progress if the partition comes back. A partition assigned
again while still held (this worker fell out of the group, paused past its session, and was
given it back) is read past this worker's last row, and records another worker wrote among this
worker's own (a zombie's, found by ``streams.cuts``) are read at the next batch: the rows they
left wrong are dirty, written again at the next point.
Records written after this worker's last row of a partition are found by asking Kafka, every
``look_every`` seconds while none of its rows is in flight, where its partitions end; when the raw
topic is quiet (no point may come) their rows are written again at once, at the point the state is at.

A publication ends between two rows when the feed is being stopped (``halt``, set by a revocation):
it writes no fragment, and its rows not yet written stay dirty, so a revocation never waits for a
publication that rewrites most of a view.

Only the views' feed thread calls ``resume``, ``handle`` and ``idle``; the endpoint reads ``row``,
``holds``, ``replaying`` and ``describe``; the engine calls ``assign`` while the feed is stopped.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from confluent_kafka import Producer

from streams import clients
from streams.config import StreamsConfig
from streams.cursor import Cursor, Raw
from streams.cuts import Cuts, Delivery, Ends, Point
from streams.docbytes import Encoders
from streams.fanout import STREAMED, Change
from streams.follow import follow
from streams.frontier import Points, fragment_value, read_point
from streams.joins import Joiner, Space
from streams.leader import Subjects, coordination_producer
from streams.metrics import StreamsMetrics, clock
from streams.publisher import Publisher
from streams.viewstore import MemoryViewStore
from streams.viewtopic import ViewTopic
from streams.writer import TableWriter, produce
from tables.change import ChangeReader
from tables.partition import partition_for
from tables.registry import Registry
from tables.views import TableShape
from tables.wire import FRAME_SIZE, UndecodableMessage, avro_body, frame, lsn_text, schema_id

log = logging.getLogger("headwater.streams")
PROGRESS = b"@applied\x1f"  # + space: the raw offset that space's state reflects, and the watermark there
PROGRESS_FORMAT = struct.Struct(">qqi")
COMMIT_EVERY = 10_000  # view rows written between commits of the endpoint's copies
COMMIT_PENDING = 20_000  # uncommitted writes that make the state committed before the next point
COMMIT_AFTER_S = 1.0  # seconds the state waits at most for a point before it is committed anyway
TABLES_KEY = b"@tables"  # the tables whose rows the state keeps (a view on a new table replays from the start)
LOOK_EVERY = 10.0  # seconds between two looks at where the held view partitions end (``Materializer._look``)
BACKLOG = 20_000  # raw changes read ahead of the barrier before the feed stops reading the raw topic
Fragment = Callable[[str, int, int, float, Ends], None]  # (writer, commit LSN, raw offset, seconds, ends): in memory


def commit_due(pending: int, age: float) -> bool:
    """Whether the state is committed after a batch with ``pending`` uncommitted writes, ``age`` seconds after its
    last commit. Points commit it (``Materializer._passed``), and an idle read; between them a batch does only when
    its writes pile up or a point is long in coming (a replay publishes nothing). Committing after every batch, as
    before, held 8% of the views thread's GIL samples on a worker holding half the partitions at a fixed 1,000
    transactions a second (all its commits: a fifth; py-spy, 2026-11-30): a RocksDB write each 5 ms batch, paid in
    full by every worker; the views' CPU fell 13% with one worker, 5% with two (``bench/RESULTS.md``). A crash
    loses nothing: the progress goes in the same write, and the reader starts from it (up to a second more to
    replay)."""
    return pending >= COMMIT_PENDING or (pending > 0 and age >= COMMIT_AFTER_S)


def progress_key(space: Space) -> bytes:
    return PROGRESS + (b"r" if space is None else b"%d" % space)


class Materializer:
    """Keeps this worker's view partitions: join state, dirty rows, publication at the agreed points."""

    def __init__(self, cfg: StreamsConfig, views: dict[str, ViewTopic], shapes: dict[str, TableShape],
                 store: MemoryViewStore, writer: TableWriter, schemas: Registry,
                 metrics: StreamsMetrics | None = None) -> None:  # fmt: skip
        self.cfg, self.views, self.shapes, self.store, self.schemas = cfg, views, shapes, store, schemas
        self.metrics = metrics or StreamsMetrics()
        self.writer = writer  # for the raw topic's first offset and where view partitions end
        self.writer_id = f"{socket.gethostname()}:{os.getpid()}"
        self.subjects = Subjects(cfg)
        self.read = ChangeReader(schemas)  # framed or nested images, as framed bytes
        topics = {n: v.topic for n, v in views.items()}
        self.cuts = Cuts(Producer(clients.view_rows_settings(cfg)), topics, self._handed)
        self.fragments = coordination_producer(clients.producer_settings(cfg))  # fragments wait for no linger
        self.publisher = Publisher(cfg, views, store, self.cuts)
        self.encoders = {name: Encoders(view.schema) for name, view in views.items()}
        self.key_columns = {name: view.key_columns for name, view in views.items()}
        self.frames: set[bytes] = set()  # the row images' value frames whose types the views were made to hold
        self.on_fragment: Fragment | None = None  # the raw owner's assembler, on that worker
        self.joiner: Joiner | None = None
        self.wanted: set[int] = set()  # the view partitions assigned (taken at the feed's next start)
        self.cursor = Cursor(cfg.changes_topic, "views", lambda: writer.low_watermark(cfg.changes_topic))
        self.position = 0  # the next raw offset to apply
        self.watermark = (-1, -1)  # of the streamed changes applied
        self.starts: dict[Space, int] = {}  # each space's progress when the reader started
        self.quiet_until = -1  # replaying: publish nothing before the reader reaches this raw offset
        self.points = Points()
        self.backlog: deque[tuple[int, Change]] = deque()  # read, not yet applied (past the barrier)
        self.at_point: tuple[int, int] | None = None  # (raw offset, commit LSN) the state is consistent at
        self.owed = False  # resumed, not published since: publishes once caught up, asked or not (``Points.owe``)
        self.unpublished = False  # the state holds changes no fragment does (streams.metrics.CutWatch)
        self.halt = threading.Event()  # set while the feed stops: a publication in hand ends between two rows
        self.stats = {"changes": 0, "batches": 0, "points": 0, "rows": 0, "busy_s": 0.0}
        self.reported = self.committed = time.monotonic()
        self.look_every = LOOK_EVERY  # seconds between two looks at the view topics' ends (``_look``)
        self.looked = time.monotonic()

    # ---- partitions and start-up ----------------------------------------------------------
    def assign(self, partitions: set[int]) -> None:
        """The view partitions this worker holds now (the engine calls it while the feed is stopped)."""
        self.wanted = set(partitions)

    def resume(self) -> int:
        """(Re)start reading: take the assigned partitions, give up the others; the raw offset to read next."""
        joiner = self.joiner or self._open()
        if self.store.pending:  # a partition given up keeps its state at its progress
            self._commit()
        for partition in sorted(joiner.held - self.wanted):
            self._give_up(partition)
        for partition in sorted(self.wanted - joiner.held):
            self._take(partition)
        for partition in sorted(self.wanted & joiner.held):
            self._keep(partition)
        self._plan()
        return self.cursor.next

    def _open(self) -> Joiner:
        self.store.open()
        self.joiner = joiner = Joiner([v.spec for v in self.views.values()], self.shapes, self.store,
                                      self.schemas.decode, encoders=self.encoders, partition_of=self._partition_of,
                                      held=set(), partitions=self.cfg.partitions, cached=self.cfg.view_cache_rows,
                                      image_partition=self._image_partition)  # fmt: skip
        kept = set(json.loads(self.store.get(TABLES_KEY) or b"[]"))
        if kept and not joiner.tables <= kept:
            self._from_the_start(joiner.tables - kept)
        self.store[TABLES_KEY] = json.dumps(sorted(joiner.tables | kept)).encode()
        self.store.commit()
        return joiner

    def _partition_of(self, view: str, values: Sequence[Any]) -> int:
        """The view partition of a base key (its values in key order): the view topic's partitioner."""
        topic = self.views[view]
        record = dict(zip(self.key_columns[view], values, strict=True))
        return partition_for(topic.key_frame + avro_body(topic.codec.parsed, record), self.cfg.partitions)

    def _image_partition(self, view: str, image: bytes) -> int | None:
        """The view partition of a base row's framed key image, undecoded, when it is framed with the key schema
        the view's keys are written with (the bodies are then the same bytes); None for any other frame."""
        topic = self.views[view]
        if image[:FRAME_SIZE] != topic.codec.frame:
            return None
        return partition_for(topic.key_of_base_key(image), self.cfg.partitions)

    def _from_the_start(self, new: set[str]) -> None:
        """A view uses tables whose rows were not kept: every space replays the raw topic from its first offset."""
        low = self.writer.low_watermark(self.cfg.changes_topic)
        log.warning("the views now use %s, whose rows were not kept: replaying %s from offset %d",
                    ", ".join(sorted(new)), self.cfg.changes_topic, low)  # fmt: skip
        if low > 0:
            log.error("%s starts at offset %d (retention): rows of %s changed before it are missing until they "
                      "change again; re-snapshot with a new capture slot to rebuild them", self.cfg.changes_topic,
                      low, ", ".join(sorted(new)))  # fmt: skip
        for key, _ in list(self.store.scan(PROGRESS)):
            self.store.pop(key, None)

    def _take(self, partition: int) -> None:
        """Hold a partition: read its view records back; every row of it, or with a record, is checked at the
        next publication (``Publisher.write``: written if it differs from its record, its endpoint copy mended if
        not). Building them here to compare, as before, built every changed row twice: at 720k under the shop's
        load, where price changes leave a worker's whole share changed, a restarted worker took ~150 s of CPU
        to take its two partitions before it read a change."""
        assert self.joiner is not None
        joiner = self.joiner
        joiner.held.add(partition)
        checked = 0
        for name, view in self.views.items():
            keys = {*joiner.base_keys(name, partition), *self.publisher.read_back(view, partition)}
            joiner.dirty[name].setdefault(partition, set()).update(keys)
            checked += len(keys)
        log.info("views: partition %d taken (%d rows to check at its first point)", partition, checked)

    def _keep(self, partition: int) -> None:
        """Hold a partition held before the feed stopped: another worker may have written it meanwhile (this one
        fell out of the group and came back, keeping it), so its records past this worker's are read."""
        for name in self.views:
            self._stray(name, partition, self.cuts.end(name, partition) or 0, "held again")

    def _strays(self) -> set[int]:
        """Read the records another worker wrote among this worker's (``streams.cuts``): the partitions where rows
        are to be written again."""
        found = self.cuts.strays()
        if found:
            self.cuts.drain()  # this worker's own rows all in place: the read ends with what it wrote last
        wrong = set()
        for name, partition, start in found:
            if self.holds(partition) and self._stray(name, partition, start, "found written by another worker"):
                wrong.add(partition)
        return wrong

    def _stray(self, name: str, partition: int, start: int, why: str) -> int:
        """Fold the records of a partition from ``start`` on; the rows they touched that differ are dirty (how
        many are dirty in the partition now)."""
        touched = self.publisher.catch_up(self.views[name], partition, start)
        if not touched:
            return 0
        self.metrics.view_strays.inc(len(touched))
        dirty = self._mark(name, self.views[name], partition, touched)
        self._commit()
        log.warning("views: %s[%d] %s: %d rows written by another worker from offset %d, %d to write again",
                    self.views[name].topic, partition, why, len(touched), start, dirty)  # fmt: skip
        return dirty

    def _look(self) -> bool:
        """Every ``look_every`` seconds, while none of this worker's rows is in flight, ask Kafka where the held
        partitions of the view topics end: records past this worker's last row of one are another writer's (a
        zombie's, written after this worker's last point), found as those among its rows are. Whether any was."""
        now = time.monotonic()
        if self.joiner is None or now - self.looked < self.look_every or not self.cuts.settled():
            return False
        self.looked = now
        ends = self.writer.latest(((view.topic, p) for view in self.views.values() for p in self.joiner.held), 2.0)
        return bool(ends and self.cuts.tails(ends))

    def _mark(self, name: str, view: ViewTopic, partition: int, keys: set[bytes]) -> int:
        """Rows of ``keys`` that differ from the view topic's latest records are dirty (the endpoint's copies of
        the others mended): how many are dirty in the partition now."""
        assert self.joiner is not None
        marks = self.joiner.dirty[name].setdefault(partition, set())
        for key in keys:
            changed, content = self.publisher.changed(self.joiner, view, key, partition)
            if changed:
                marks.add(key)
            else:
                self.publisher.mend(view, key, content, partition)
        return len(marks)

    def _give_up(self, partition: int) -> None:
        assert self.joiner is not None
        self.joiner.held.discard(partition)
        for marks in self.joiner.dirty.values():
            marks.pop(partition, None)
        self.publisher.drop(partition)
        log.info("views: partition %d given up", partition)

    def _plan(self) -> None:
        """Where the reader starts (the lowest progress) and until where it replays quietly (the highest)."""
        assert self.joiner is not None
        low = None
        saved: dict[Space, tuple[int, int, int]] = {}
        for space in [None, *sorted(self.joiner.held)]:
            found = self.store.get(progress_key(space))
            if found is None:
                low = self.writer.low_watermark(self.cfg.changes_topic) if low is None else low
            saved[space] = PROGRESS_FORMAT.unpack(found) if found else (low or 0, -1, -1)
        self.starts = {space: at[0] for space, at in saved.items()}
        first = min(saved.values())
        self.position, self.watermark = first[0], (first[1], first[2])
        self.quiet_until = max(self.starts.values())
        self.cursor.reset(self.position)
        self.points, self.backlog, self.at_point = Points(), deque(), self._resumed_at()
        self.owed = True
        log.info("views of partitions %s resume at raw offset %d (quiet until offset %d, commit LSN %s published)",
                 sorted(self.joiner.held), self.position, self.quiet_until,
                 lsn_text(max(self.publisher.published_lsn.values(), default=0)))  # fmt: skip

    def _resumed_at(self) -> tuple[int, int] | None:
        """The consistent point the state is at when every space stands at one raw offset: (offset, commit LSN)
        of the change before it when that change ends a transaction (read back), else None. So a point asked for
        while the raw topic stays quiet after a rebalance is published here, not only once a change comes."""
        if self.position == 0 or self.position < self.quiet_until:
            return None
        for offset, _, value in self.writer.raw(self.position - 1, self.position):
            change = self._change(value)
            return (offset, change.commit_lsn) if change is not None and change.ends_transaction else None
        return None

    # ---- changes ------------------------------------------------------------------------
    def handle(self, batch: Sequence[Raw], points: Sequence[bytes] = ()) -> None:
        """Raw changes (offset, key, value) and points records read: apply what the barrier allows,
        publish at the points it resolves, commit the state."""
        started, rows = clock(), self.stats["rows"]
        for value in points:
            self.points.read(*read_point(value))
        self._look()
        self._strays()
        self.backlog.extend(self._admit(batch))
        applied = self._advance()
        if self.owed and self.points.owe(self.position):
            self.owed = False
        if self.at_point is not None and self._publishing(self.at_point[0]) and self.points.resolves(self.at_point[0]):
            self.publish(*self.at_point)
            self._commit()
        self.stats["changes"] += applied
        self.stats["batches"] += 1
        self.stats["busy_s"] += self.metrics.spent("views", started)
        self.metrics.applied(applied, int(self.stats["rows"] - rows))
        self.unpublished = (self.joiner is not None and self.joiner.waiting()) or bool(self.cuts.pending)
        if batch:
            self.report(batch[-1][0])

    def crowded(self) -> bool:
        """Whether the feed should stop reading the raw topic until the barrier moves."""
        return len(self.backlog) > BACKLOG

    def _admit(self, batch: Sequence[Raw]) -> list[tuple[int, Change]]:
        """The batch's new, decodable changes (the fan-out dead-letters the rest)."""
        out = []
        for offset, _, value in self.cursor.admit(batch):
            change = self._change(value)
            if change is not None:
                out.append((offset, change))
        return out

    def _change(self, value: bytes | None) -> Change | None:
        """A raw record's change, None if it has none or cannot be decoded (the fan-out dead-letters it)."""
        if value is None:
            return None
        try:
            return Change.from_record(self.read(value))
        except (UndecodableMessage, KeyError, TypeError):
            return None

    def _advance(self) -> int:
        """Apply the changes read that the barrier allows (all while replaying): how many were applied."""
        assert self.joiner is not None
        joiner, applied = self.joiner, 0
        while self.backlog and (self.backlog[0][0] < self.quiet_until or self.points.allows(self.backlog[0][0])):
            self._follow(self.backlog[0][1])
            offset, change = self.backlog.popleft()
            if change.op in STREAMED:
                ident = (change.commit_lsn, change.position)
                if ident <= self.watermark:  # capture sent it twice: the state stays where it is
                    self.position = offset + 1
                    continue
                self.watermark = ident
            joiner.apply(change, self._live(offset))
            applied += 1
            self._passed(offset, change)
        if commit_due(len(self.store.pending), time.monotonic() - self.committed):
            self._commit()
        return applied

    def _follow(self, change: Change) -> None:
        """A row image framed with a value schema not met before: every view showing its table is made to hold its
        columns' types (``streams.follow``; an ``ALTER ... TYPE`` widened one), registered, written with from now."""
        assert self.joiner is not None
        image = change.after
        if image is None or image[:FRAME_SIZE] in self.frames:
            return
        table = f"{change.schema}.{change.table}"
        if table in self.joiner.nodes:
            columns = {f["name"]: f for f in self.schemas.schema(schema_id(image))["fields"]}
            for name, view in list(self.views.items()):
                schema = follow(view.schema, table, columns)
                if schema is not view.schema:
                    self._swap(name, schema, table, schema_id(image))
        self.frames.add(image[:FRAME_SIZE])

    def _swap(self, name: str, schema: dict[str, Any], table: str, table_schema: int) -> None:
        """A view written with a wider schema from now on (its records written before keep theirs)."""
        assert self.joiner is not None
        view = self.views[name]
        value_id = self.schemas.register(f"{view.topic}-value", schema, table=f"view {name}")
        self.views[name] = replace(view, schema=schema, value_frame=frame(value_id))
        self.encoders[name] = self.joiner.encoders[name] = Encoders(schema)
        self.joiner.recode()  # encodings made with the old schema
        log.warning("view %s now holds the types of %s's columns as its value schema %d has them (an ALTER ... TYPE "
                    "widened one): its rows are written with schema id %d as they change; those written before keep "
                    "theirs", name, table, table_schema, value_id)  # fmt: skip

    def _live(self, offset: int) -> Callable[[Space], bool]:
        """Which spaces apply the change at ``offset``: those whose state is not past it."""
        return lambda space: offset >= self.starts.get(space, 0)

    def _passed(self, offset: int, change: Change) -> None:
        """``offset`` is applied: publish here if it is a consistent point a points record asks for."""
        self.position = offset + 1
        self.at_point = (offset, change.commit_lsn) if change.ends_transaction else None
        if self.at_point is not None and self.points.resolves(offset) and self._publishing(offset):
            self._commit()
            self.publish(offset, change.commit_lsn)

    def _publishing(self, offset: int) -> bool:
        """Whether the state at ``offset`` (applied) may be published: every space has reached it."""
        return offset + 1 >= self.quiet_until

    def _commit(self) -> None:
        """Commit the state with the progress of every space it holds (those at or past their own)."""
        assert self.joiner is not None
        progress = PROGRESS_FORMAT.pack(self.position, *self.watermark)
        for space in [None, *self.joiner.held]:
            if self.position >= self.starts.get(space, 0):
                self.store[progress_key(space)] = progress
        self.store.commit()
        self.committed = time.monotonic()

    def idle(self) -> None:
        """Nothing new to read: now and then a look at the view topics' tails (``_look``). The rows another writer
        left wrong there are written again at once, at the consistent point the state is at, if it is at one (else
        at the next point): with the raw topic quiet no point may come (a publication at a point no other worker
        publishes adds a fragment no cut uses). Only those partitions: a zombie's others wait for a point."""
        wrong = self._strays() if self._look() else set()
        if wrong and self.at_point is not None and self._publishing(self.at_point[0]):
            self.publish(*self.at_point, only=wrong)
        if self.joiner is not None and self.store.pending:  # quiet: what was applied is committed
            self._commit()
        self.unpublished = (self.joiner is not None and self.joiner.waiting()) or bool(self.cuts.pending)

    def replaying(self) -> int | None:
        """The raw offset a replay must pass before anything is published, while below it."""
        return self.quiet_until if self.joiner is not None and self.position < self.quiet_until else None

    # ---- publication --------------------------------------------------------------------
    def publish(self, offset: int, lsn: int, only: set[int] | None = None) -> None:
        """Write the changed view rows of the partitions held (``only`` those) as of ``lsn`` (not waiting); their
        fragment follows once Kafka has them."""
        assert self.joiner is not None
        started = time.monotonic()
        self.owed = self.owed and only is not None
        self.joiner.expand()
        parts = []
        for partition in sorted(self.joiner.held if only is None else self.joiner.held & only):
            if lsn < self.publisher.published_lsn.get(partition, -1):
                continue  # its records carry a newer point (another worker held it): not back to an older one
            for name, view in self.views.items():
                if not self._write_rows(name, view, partition, lsn):
                    log.info("views: the publication at %s stopped part way (the feed stops): no fragment of it",
                             lsn_text(lsn))  # fmt: skip
                    return
                parts.append((name, partition))
        if parts:
            self.cuts.point(lsn, offset, parts, time.monotonic() - started)
            self.stats["points"] += 1

    def _write_rows(self, name: str, view: ViewTopic, partition: int, lsn: int) -> bool:
        """Write a partition's dirty rows of a view: whether all (``halt`` stops it between two rows, the rest
        left dirty: a revocation does not wait for a publication that rewrites most of a view)."""
        assert self.joiner is not None
        keys = sorted(self.joiner.dirty[name].pop(partition, set()))
        for n, key in enumerate(keys, 1):
            if self.halt.is_set():
                self.joiner.dirty[name].setdefault(partition, set()).update(keys[n - 1 :])
                return False
            self.stats["rows"] += self.publisher.write(self.joiner, view, key, lsn, partition)
            if n % COMMIT_EVERY == 0:  # a snapshot's end publishes every row: its copies go in parts
                self._commit()
        return True

    @property
    def on_rows(self) -> Callable[[int, list[Delivery]], None] | None:
        """Who gets a point's rows as Kafka acknowledged them (the Redis mirror beside, on the raw owner)."""
        return self.cuts.on_rows

    @on_rows.setter
    def on_rows(self, hook: Callable[[int, list[Delivery]], None] | None) -> None:
        self.cuts.on_rows = hook

    def _handed(self, point: Point, ends: Ends) -> None:
        """A point's rows are all acknowledged (the cuts' poller thread): its fragment goes out."""
        value = fragment_value(self.subjects.fragment(), self.writer_id, point.lsn, point.offset, point.seconds, ends)
        produce(self.fragments, self.cfg.fragments_topic, 0, None, value, [])
        self.fragments.poll(0)
        hook = self.on_fragment  # (unhooked by another thread when this worker stops owning the raw partition)
        if hook is not None:
            hook(self.writer_id, point.lsn, point.offset, point.seconds, ends)

    # ---- reading ------------------------------------------------------------------------
    def report(self, offset: int, every: float = 10.0) -> None:
        """A progress line every ``every`` seconds: changes, batches, points published, rows written."""
        now = time.monotonic()
        if now - self.reported < every:
            return
        s, span = self.stats, now - self.reported
        log.info("views at raw offset %d: %.0f changes/s in %d batches, %d points published, %d rows written "
                 "(%.0f%% busy); last point published %s", offset, s["changes"] / span, s["batches"], s["points"],
                 s["rows"], 100 * s["busy_s"] / span, self._point_text())  # fmt: skip
        self.stats = dict.fromkeys(self.stats, 0)
        self.reported = now

    def holds(self, partition: int) -> bool:
        return self.joiner is not None and partition in self.joiner.held

    def row(self, view: str, key: bytes, partition: int) -> tuple[int, dict[str, Any]] | None:
        """(commit LSN, document) of a view row as last published, or None."""
        return self.publisher.row(view, key, partition)

    def _point_text(self) -> str:
        handed = self.cuts.last()
        return "none" if handed is None else lsn_text(handed)

    def drain(self, timeout: float = 60.0) -> bool:
        """Until Kafka acknowledged every view row written and every fragment (False: not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        return self.cuts.drain(timeout) and self.fragments.flush(max(deadline - time.monotonic(), 0.0)) == 0

    def close(self) -> None:
        """Stop handing points on (the poller thread ends; the next run publishes what is left)."""
        self.cuts.close()
        self.fragments.flush(10)

    def describe(self) -> dict[str, Any]:
        handed = self.cuts.last()
        return {"point_lsn": None if handed is None else lsn_text(handed), "rows_published": self.publisher.published,
                "partitions_here": sorted(self.joiner.held) if self.joiner else [],
                "views": [{"name": v.spec.name, "base": v.spec.base, "topic": v.topic, "key": v.key_columns,
                           "joins": [j.path for j in v.spec.joins]} for v in self.views.values()]}  # fmt: skip
