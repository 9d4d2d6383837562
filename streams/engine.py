"""The streams engine: the fan-out, the table feed and the views, wired from collaborators, with no host.

Promise: ``open_catalog`` is the engine's only I/O before it starts: it discovers the captured
tables through the registry, each served with the key schema its records are keyed with (the fan-out's
checkpoint says which: ``written_keys``; ``discover`` looks again, at every look on the worker running the fan-out,
every ``KEYS_LOOK_EVERY`` s on the others) (with
discovery on, a worker started before capture registered the views' tables waits for them: ``view_tables``),
validates the view specs against them (registering the views' schemas) and makes every topic — compacted, with
``[streams] partitions`` partitions — before anything reads one. ``Engine`` is given its settings, registry,
writer, catalog and stores; the host (``streams.host``, a Faust app) tells it which partitions this worker is
assigned (``assigned``), when they are taken away (``revoked``) and when to stop (``close``, which stops
every thread the engine started); ``discover`` finds the tables capture registered since the catalog
was made (their topics made) and ``adopt`` serves them from then on (the host adds their topics to the
group's subscription). The owner of the raw partition runs the fan-out
(``streams.fanrun`` on a ``streams.feed.Feed``) and, with views, the points' announcer and the
cuts' assembler (``streams.leader``) and the Redis mirror (``streams.mirror``). Every worker that
holds partitions of the view topics keeps those partitions' views (``streams.materializer`` on a
``streams.feed.ViewFeed``); a revocation returns only once Kafka acknowledged every view row it
wrote. The table-topic partitions assigned are read into the table store by one
``streams.tablefeed.TableFeed``, restarted at every rebalance. A feed's fatal
error goes to ``on_fatal`` (the host stops the worker). ``metrics`` (``streams.metrics``) holds every
part's counters and reads the engine's progress when scraped (the views' cut and its age only while
this worker owns the raw partition), and its readers report librdkafka's statistics to
``metrics.kafka`` (does Kafka answer); ``unready`` says why this worker does not serve everything
yet (no partitions yet, tables not loaded since they were assigned, the fan-out behind where the raw
topic ended at start, views replaying), None once it does. Nothing here imports Faust.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from confluent_kafka import KafkaException

from streams import clients
from streams.catalog import KeyCodec, TableTopic, discover, registered, rekeyed_tables, served
from streams.clients import reader_settings
from streams.config import StreamsConfig
from streams.cursor import Raw
from streams.fanrun import FanOutRun
from streams.feed import Feed, Follower, ViewFeed
from streams.frontier import HandOff, Pace
from streams.leader import Announcer, Assembler, coordination_producer
from streams.materializer import Materializer
from streams.metrics import StreamsMetrics, Watcher
from streams.mirror import RedisMirror
from streams.sources import Sources, adopt, read_ids
from streams.store import TableStore
from streams.tablefeed import Backlog, Part, Progress, TableFeed
from streams.viewstore import ViewStore
from streams.viewtopic import ViewTopic, setup_views
from streams.writer import TableWriter
from tables.errors import FatalError, RetryableError
from tables.kafka import bounds
from tables.logs import facts
from tables.registry import Registry
from tables.views import CAPTURED_WHEN, TableShape, ViewSpec
from tables.wire import schema_id

log = logging.getLogger("headwater.streams")
Fatal = Callable[[str, FatalError], None]  # (which part stopped, why): called from the part's thread
WAIT_WARN_EVERY = 60.0  # seconds between two WARNINGs while a worker waits at start for its views' tables
Settings = Callable[[str], dict[str, Any]]  # a reader's librdkafka settings, by the reader's name
KEYS_LOOK_EVERY = 30.0  # seconds between two looks at the served tables' key schemas (``rekeyed_tables``)


@dataclass(frozen=True)
class Catalog:
    """The captured tables the workers serve and the views they keep."""

    tables: Sequence[TableTopic]
    views: dict[str, ViewTopic]
    shapes: dict[str, TableShape]

    @property
    def topics(self) -> frozenset[str]:
        return frozenset(t.topic for t in self.tables)

    def find(self, name: str) -> TableTopic | None:
        """A table by URL name: ``customers`` (public), ``schema.table`` or its topic."""
        return next((t for t in self.tables if name in (t.short, t.qualified, t.topic)), None)


@dataclass(frozen=True)
class Found:
    """Tables capture registered since the catalog was made, with the ids of their topics (made by now)."""

    tables: list[TableTopic]
    ids: dict[str, str]
    rekeyed: list[TableTopic] = field(default_factory=list)  # served tables whose key schema changed, with the new


def open_catalog(cfg: StreamsConfig, specs: Sequence[ViewSpec], schemas: Registry, writer: TableWriter,
                 sleep: Callable[[float], None] = time.sleep) -> Catalog:  # fmt: skip
    """Discover the tables, check and register the views, make every topic (see the module promise)."""
    tables = view_tables(cfg, specs, schemas, sleep)
    writer.ensure_topics([t.topic for t in tables])
    writer.ensure_topics([cfg.dlq_topic], partitions=1, compact=False)
    views, shapes = setup_views(cfg, specs, tables, schemas, writer)  # view keys: the newest, as registered before
    written = written_keys(writer)
    rekeyed = {t.topic: t for t in rekeyed_tables([t for t in tables if t.topic in written], schemas, written)}
    return Catalog([rekeyed.get(t.topic, t) for t in tables], views, shapes)


def written_keys(writer: TableWriter) -> dict[str, int]:
    """Table topic -> the key schema id of its records, as the fan-out's checkpoint has it (none before the first)."""
    try:
        saved = writer.checkpoint()
    except KafkaException as exc:
        raise RetryableError(f"reading the fan-out's checkpoint (the key schema of each table topic): {exc}") from exc
    return saved.key_schemas if saved is not None else {}


def view_tables(cfg: StreamsConfig, specs: Sequence[ViewSpec], schemas: Registry,
                sleep: Callable[[float], None]) -> list[TableTopic]:  # fmt: skip
    """The captured tables, once they hold every table the views join: a worker started before capture registered
    them waits, looking every ``discover_every`` seconds (a WARNING at once and every ``WAIT_WARN_EVERY`` seconds
    names what it waits for), as it serves tables captured later. Without discovery (``discover_every = 0``, or
    ``[streams] tables``) it does not wait: the views' check then says what is missing."""
    wanted = {table for spec in specs for table in spec.tables}
    warned: float | None = None
    while True:
        tables = discover(cfg, schemas)
        missing = sorted(wanted - {t.qualified for t in tables})
        if not missing or not cfg.discover_every or cfg.table_names:
            if warned is not None:
                log.info("the views' tables are captured now: the worker starts")
            return tables
        if warned is None or time.monotonic() - warned >= WAIT_WARN_EVERY:
            warned = time.monotonic()
            log.warning("views %s wait for %s to be captured with a key (captured so far: %s); looking again every "
                        "%g s (%s)", ", ".join(sorted(s.name for s in specs if s.tables & set(missing))),
                        ", ".join(missing), ", ".join(t.qualified for t in tables) or "none", cfg.discover_every,
                        CAPTURED_WHEN)  # fmt: skip
        sleep(cfg.discover_every)


class Owner:
    """What the raw partition's owner runs (``streams.feed``): the fan-out and, with views, the points'
    announcer, the cuts' assembler (``streams.leader``) and the Redis mirror."""

    def __init__(self, cfg: StreamsConfig, run: FanOutRun, views: Materializer | None,
                 mirror: Callable[[], RedisMirror] | None, on_fatal: Fatal, settings: Settings,
                 tell: Callable[[bytes], None] | None = None) -> None:  # fmt: skip
        self.cfg, self.run, self.views, self.make_mirror, self.on_fatal = cfg, run, views, mirror, on_fatal
        self.settings, self.tell = settings, tell
        self.feeds: list[Follower] = []
        parts = [(name, p) for name in views.views for p in range(cfg.partitions)] if views is not None else []
        self.pace = Pace(cfg.view_point_interval, parts)
        self.producer = coordination_producer(clients.producer_settings(cfg)) if views is not None else None
        self.assembler: Assembler | None = None
        self.mirror: RedisMirror | None = None

    def start(self) -> None:
        if self.feeds:
            return
        views, producer = self.views, self.producer
        if views is None or producer is None:
            self.feeds.append(self._feed("fan-out", self.run.resume, self.run.handle, self.run.tick))
        else:
            subjects, topics = views.subjects, {n: v.topic for n, v in views.views.items()}
            announcer = Announcer(self.cfg, producer, subjects, self.pace, views.writer_id, self.tell)
            fanned: list[Feed] = []  # the points ride on the fan-out's reader: its fetches tell the raw end

            def handle(batch: list[Raw]) -> None:
                self.run.handle(batch)
                announcer.saw(fanned[0].end)

            def tick() -> None:
                self.run.tick()
                announcer.saw(fanned[0].end)

            fanned.append(self._feed("fan-out", self.run.resume, handle, tick))
            self.assembler = Assembler(self.cfg, producer, subjects, self.pace, topics, self._fatal("cuts"))
            views.on_fragment = self.assembler.add
            self.feeds += [fanned[0], self.assembler]
            if self.make_mirror is not None:
                self.mirror = self.make_mirror()
                self.assembler.on_cut = self.mirror.take
                views.on_rows = self.mirror.hand
                self.mirror.start()
        for feed in self.feeds:
            feed.start()

    def stop(self) -> None:
        """Stop reading; state is reloaded by whoever owns the partition next (maybe this worker)."""
        if self.views is not None:
            self.views.on_fragment = None  # before the feeds stop: no fragment, nor cut, reaches a stopped mirror
            self.views.on_rows = None
        if self.assembler is not None:
            self.assembler.on_cut = None
        for feed in self.feeds:
            feed.stop()
        self.feeds.clear()
        self.run.stop()
        self.assembler = None
        if self.mirror is not None:
            self.mirror.stopping.set()
            self.mirror.join(timeout=10)
        if self.producer is not None:
            self.producer.flush(10)

    def _fatal(self, name: str) -> Callable[[FatalError], None]:
        return lambda exc: self.on_fatal(name, exc)

    def _feed(self, name: str, start: Callable[[], int], handle: Callable[[list[Raw]], None],
              idle: Callable[[], None]) -> Feed:  # fmt: skip
        return Feed(name, self.cfg.changes_topic, self.settings(name), start=start, handle=handle, idle=idle,
                    on_fatal=self._fatal(name), batch_size=self.cfg.batch_size, wait=self.cfg.batch_wait)  # fmt: skip


class Views:
    """The views' feed of the view partitions this worker holds (``streams.materializer``)."""

    def __init__(self, cfg: StreamsConfig, views: Materializer, on_fatal: Fatal, settings: Settings) -> None:
        self.cfg, self.views, self.on_fatal, self.settings = cfg, views, on_fatal, settings
        self.feed: ViewFeed | None = None

    def start(self, partitions: set[int]) -> None:
        self.stop()
        if not partitions:
            return
        self.views.assign(partitions)
        views = self.views
        views.halt.clear()
        self.feed = ViewFeed("views", self.cfg.changes_topic, self.cfg.points_topic, self.settings("views"),
                             start=views.resume, handle=views.handle, idle=views.idle, crowded=views.crowded,
                             on_fatal=lambda exc: self.on_fatal("views", exc), batch_size=self.cfg.batch_size,
                             wait=self.cfg.batch_wait, handoff=HandOff())  # fmt: skip
        self.feed.start()

    def tell(self, point: bytes) -> None:
        """A points record the announcer beside these views wrote (``streams.frontier.HandOff``)."""
        feed = self.feed
        if feed is not None:
            feed.handoff.tell(point)

    def stop(self) -> None:
        """Stop the feed, then wait until Kafka has every view row written (a revocation returns only then:
        the next owner of a partition reads it back complete)."""
        if self.feed is None:
            return
        self.views.halt.set()  # a publication in hand ends between two rows (its rows so far are no point's)
        self.feed.stop()
        self.feed = None
        if not self.views.drain():
            log.warning("views: Kafka did not acknowledge every view row within 60 s of giving partitions up")


class Tables:
    """The table feed of the table-topic partitions this worker is assigned (``streams.tablefeed``)."""

    def __init__(self, cfg: StreamsConfig, store: TableStore, topics: Collection[str], on_fatal: Fatal,
                 settings: Settings) -> None:  # fmt: skip
        self.cfg, self.store, self.topics, self.on_fatal = cfg, store, frozenset(topics), on_fatal
        self.settings = settings
        self.feed: TableFeed | None = None

    def start(self, assigned: Collection[Part]) -> None:
        parts = sorted(part for part in assigned if part[0] in self.topics)
        if self.feed is not None and self.feed.is_alive() and sorted(self.feed.progress) == parts:
            return
        self.stop()
        if not parts:
            return
        if self.store.db is None:
            self.store.open()
        self.feed = TableFeed(self.store, self.settings("tables"), parts, batch_size=self.cfg.batch_size,
                              wait=self.cfg.batch_wait, on_fatal=lambda exc: self.on_fatal("tables", exc))  # fmt: skip
        self.feed.start()

    def stop(self) -> None:
        if self.feed is not None:
            self.feed.stop()
            self.feed = None

    def progress(self, part: Part) -> Progress | None:
        """The partition's progress if this worker reads it now (None: not assigned here)."""
        return None if self.feed is None else self.feed.progress.get(part)


class Engine:
    """Everything a worker runs, given its collaborators; the host drives it by assignment."""

    def __init__(self, cfg: StreamsConfig, schemas: Registry, writer: TableWriter, catalog: Catalog,
                 store: TableStore, view_store: ViewStore, on_fatal: Fatal,
                 sources: Sources | None = None) -> None:  # fmt: skip
        self.cfg, self.schemas, self.writer, self.catalog = cfg, schemas, writer, catalog
        self.keys_looked = time.monotonic()  # when the served tables' key schemas were last looked at
        self.key_codecs: dict[int, KeyCodec] = {}  # key schema id -> its codec (``moving_key``)
        self.store, self.view_store, self.sources = store, view_store, sources
        self.metrics = metrics = StreamsMetrics(cfg.cut_warn_after, cfg.bootstrap)
        self.fanout = FanOutRun(cfg, schemas, writer, catalog.topics, metrics)
        views = catalog.views
        self.views = Materializer(cfg, views, catalog.shapes, view_store, writer, schemas, metrics) if views else None
        mirror = (lambda: RedisMirror(cfg, views, schemas, metrics)) if views and cfg.redis_url != "none" else None
        self.viewing = Views(cfg, self.views, on_fatal, self.reader) if self.views is not None else None
        self.owner = Owner(cfg, self.fanout, self.views, mirror, on_fatal, self.reader,
                           tell=self.viewing.tell if self.viewing is not None else None)  # fmt: skip
        self.view_topics = frozenset(v.topic for v in views.values())
        self.tables = Tables(cfg, store, catalog.topics, on_fatal, self.reader)
        self.backlog = Backlog(self.raw_end, self.fanned)
        self.assignments = 0  # rebalances this worker was told of
        metrics.sources.raw, metrics.sources.cut, metrics.sources.redis = self.raw_positions, self.cut, self.redis
        metrics.sources.cut_age = lambda: metrics.cut.age() if self.views is not None and self.viewing_feed() else None
        metrics.sources.tables = lambda: dict(self.tables.feed.progress) if self.tables.feed else {}
        self.watcher = Watcher([self.watch_cut, metrics.kafka.check])

    def reader(self, name: str) -> dict[str, Any]:
        """A reader's librdkafka settings, its statistics reported to ``metrics.kafka`` as ``name``."""
        return self.metrics.kafka.settings(name, reader_settings(self.cfg, table_feed=name == "tables", follows=True))

    def viewing_feed(self) -> bool:
        """Whether this worker keeps view partitions now."""
        return self.viewing is not None and self.viewing.feed is not None

    @property
    def mirror(self) -> RedisMirror | None:
        """The Redis mirror, while this worker owns the raw partition."""
        return self.owner.mirror

    @property
    def raw(self) -> Part:
        return (self.cfg.changes_topic, 0)

    def assigned(self, parts: Collection[Part]) -> None:
        """This worker now holds ``parts`` (topic, partition): read the tables among them, and the raw topic."""
        if not self.backlog.is_alive() and not self.backlog.done.is_set():
            self.backlog.start()
        if not self.watcher.is_alive() and not self.watcher.stopping.is_set():
            self.watcher.start()
        self.assignments += 1
        self.tables.start(parts)
        if self.raw in parts:
            self.owner.start()
        if self.viewing is not None:
            self.viewing.start({p for topic, p in parts if topic in self.view_topics})

    def discover(self) -> Found:
        """The tables capture registered since the catalog was made, their topics made (registry and broker I/O:
        the host runs it off its loop; ``adopt`` then serves them)."""
        new = served(self.cfg, registered(self.cfg, self.schemas, skip=self.catalog.topics))
        rekeyed = self.rekeyed()
        if not new:
            return Found([], {}, rekeyed)
        topics = [t.topic for t in new]
        self.writer.ensure_topics(topics)
        return Found(new, read_ids(self.writer.admin, topics), rekeyed)

    def rekeyed(self) -> list[TableTopic]:
        """The served tables whose records are keyed with another key schema now: at every look from this worker's
        own fan-out while it runs one (its newest checkpoint, in memory: no request), else from the checkpoint on
        the broker every ``KEYS_LOOK_EVERY`` s (a request per table: not at every look)."""
        self.know_moving_keys()
        own = self.fanout.last if self.fanout.fanout is not None else None
        if own is not None:
            moved = [t for t in self.catalog.tables if own.key_schemas.get(t.topic, t.key.schema_id) != t.key.schema_id]
            return rekeyed_tables(moved, self.schemas, own.key_schemas)
        if time.monotonic() - self.keys_looked < KEYS_LOOK_EVERY:
            return []
        self.keys_looked = time.monotonic()
        return rekeyed_tables(self.catalog.tables, self.schemas, written_keys(self.writer))

    def moving_key(self, table: TableTopic) -> KeyCodec | None:
        """On the worker running the fan-out, while it moves ``table``'s rows to another key schema of the same key
        columns (it routed a change keyed with it; the endpoint reads keys with the one before until the checkpoint
        after the move names it, ``rekeyed``): that key schema's codec, once a look fetched it (no I/O here: the
        endpoint calls it on the host's loop). Else None."""
        moving = self._moving_frame(table, self._fanout_frames())
        if moving is None:
            return None
        codec = self.key_codecs.get(schema_id(moving))
        return codec if codec is not None and codec.columns == table.key.columns else None

    def know_moving_keys(self) -> None:
        """Fetch the codecs ``moving_key`` gives (registry I/O: run off the host's loop, from ``discover``)."""
        frames = dict(self._fanout_frames())
        for table in self.catalog.tables:
            moving = self._moving_frame(table, frames)
            sid = None if moving is None else schema_id(moving)
            if sid is not None and sid not in self.key_codecs:
                self.key_codecs[sid] = KeyCodec(sid, self.schemas.schema(sid))

    def _fanout_frames(self) -> Mapping[str, bytes]:
        """The key frame of each table topic as the fan-out running here last routed it (none elsewhere)."""
        fan = self.fanout.fanout
        return fan.frames if fan is not None else {}

    @staticmethod
    def _moving_frame(table: TableTopic, frames: Mapping[str, bytes]) -> bytes | None:
        """The key frame the fan-out moves ``table``'s rows to, when it differs from the one the endpoint reads."""
        moving = frames.get(table.topic)
        return moving if moving is not None and moving != table.key.frame else None

    def adopt(self, found: Found) -> list[str]:
        """Serve ``found``'s tables from now on (the endpoint, the table feed at the next assignment, the fan-out):
        the topics the host adds to the group's subscription. Call it where ``assigned`` is called (it may open
        the table store)."""
        if self.sources is not None and found.ids:
            adopt(self.sources, found.ids, self.store)
        moved = {t.topic: t for t in found.rekeyed}
        for table in found.rekeyed:
            log.warning("table %s is keyed with key schema %d now (was %d): the endpoint reads its keys with it",
                        table.qualified, table.key.schema_id,
                        next((t.key.schema_id for t in self.catalog.tables if t.topic == table.topic), -1),
                        extra=facts(table=table.qualified, topic=table.topic))  # fmt: skip
        tables = sorted([moved.get(t.topic, t) for t in self.catalog.tables] + found.tables, key=lambda t: t.qualified)
        self.catalog = replace(self.catalog, tables=tables)
        topics = [t.topic for t in found.tables]
        self.tables.topics = self.tables.topics | set(topics)
        self.fanout.served = self.fanout.served | set(topics)
        for table in found.tables:
            log.info("now serving table %s (topic %s): its partitions are read once the group assigns them",
                     table.qualified, table.topic, extra=facts(table=table.qualified, topic=table.topic))  # fmt: skip
        return topics

    def revoked(self) -> None:
        """Another worker may hold the partitions next: stop reading (blocks until the feeds stopped and
        Kafka has every view row written)."""
        if self.viewing is not None:
            self.viewing.stop()
        self.owner.stop()
        self.metrics.cut.reset()
        self.tables.stop()

    def close(self) -> None:
        """Stop every thread the engine started and close the stores."""
        self.revoked()
        self.watcher.stopping.set()
        self.backlog.stopping.set()
        for thread in (self.backlog, self.watcher):
            if thread.is_alive():
                thread.join(timeout=10)
        if self.views is not None:
            self.views.close()
        self.store.close()
        self.view_store.close()

    def raw_end(self) -> int:
        """The raw topic's true end (fetched: the local broker's ListOffsets can answer short)."""
        return bounds(reader_settings(self.cfg), self.cfg.changes_topic, 0)[1]

    def fanned(self) -> int:
        """The raw offset the fan-out's checkpoint says it wrote everything below."""
        saved = self.writer.checkpoint()
        return saved.raw_offset if saved else 0

    # ---- what the metrics and the readiness probe read ------------------------------------
    def unready(self) -> str | None:
        """Why this worker does not serve everything it holds yet, or None when it does."""
        if not self.assignments:
            return "waiting for the consumer group to assign partitions"
        feed = self.tables.feed
        loading = [p for p in feed.progress.values() if not p.loaded] if feed is not None else []
        if loading:
            behind = sum(max(p.end - p.offset, 0) for p in loading)
            return f"loading tables: {len(loading)} partitions not read to their end ({behind} records to go)"
        backlog = self.backlog
        if not backlog.done.is_set():
            return (f"the fan-out is at raw offset {backlog.at} of {backlog.target}, where the raw topic ended when "
                    "this worker started")  # fmt: skip
        replay = self.views.replaying() if self.views is not None and self.viewing and self.viewing.feed else None
        if replay is not None:
            return f"the views replay the raw topic up to offset {replay} before publishing again"
        return None

    def raw_positions(self) -> dict[str, tuple[int, int]]:
        """Reader -> (next raw offset, the raw topic's end as last fetched): the fan-out's while this worker
        owns the raw partition, the views' while it holds view partitions."""
        found = {feed.label: (self.fanout.cursor.next, feed.end) for feed in list(self.owner.feeds)
                 if feed.label == "fan-out" and isinstance(feed, Feed)}  # fmt: skip
        feed = self.viewing.feed if self.viewing is not None else None
        if feed is not None and self.views is not None:
            found["views"] = (self.views.position, feed.end)
        return found

    def cut(self) -> int | None:
        """The views' last cut on the raw partition's owner (which makes them), else this worker's last point
        while it keeps view partitions (None elsewhere)."""
        assembler = self.owner.assembler
        if assembler is not None:
            return assembler.last()
        return self.views.cuts.last() if self.views is not None and self.viewing_feed() else None

    def redis(self) -> dict[str, tuple[int, int]]:
        """View -> (commit LSN of the cut Redis shows, of the newest cut seen), as this worker's mirror knows."""
        mirror = self.mirror
        if mirror is None:
            return {}
        newest = {name: int(cut["commit_lsn"]) for name, cut in list(mirror.cuts.items())}
        return {name: (lsn, max(newest.get(name, lsn), lsn)) for name, lsn in list(mirror.applied.items())}

    def watch_cut(self, now: float) -> None:
        """Every second (``streams.metrics.Watcher``): how long this worker's publications have stood still,
        while it keeps view partitions (``revoked`` resets the watch)."""
        if self.views is not None and self.viewing_feed():
            self.metrics.cut.observe(self.views.cuts.last(), self.views.unpublished, now)
