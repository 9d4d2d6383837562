"""The stream agents: the fan-out of the raw topic, the views, and the table agent behind the Faust tables.

Promise: the worker Faust assigns ``<prefix>.changes`` to (the ``raw`` agent holds it)
reads it in order, in batches, once its tables are recovered and until the partition
is revoked (``streams.feed``): one feed for the fan-out, one for the views. Each
fan-out batch is routed (``streams.fanout``) and written without waiting; the
fan-out's own checkpoint (``<prefix>.changes.fanout``) moves only to where Kafka
acknowledged every record, and a (re)started fan-out resumes from it — so a crash
replays what was unacknowledged, which the fan-out recognises (partition tails,
watermark) and does not write twice. A message
that cannot be decoded goes to ``<prefix>.changes.dlq`` with its offset and the reason,
is counted and logged, and the stream goes on. The table-topic partitions Faust assigns
to a worker are read into its table store by one ``streams.tablefeed.TableFeed``, restarted
at every rebalance (``Tables``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from faust.types import TP

from streams import profile
from streams.app import app, cfg
from streams.cursor import Cursor, Raw
from streams.fanout import STREAMED, Change, FanOut, Truncate, headers, live_keys, truncate_outputs
from streams.feed import Feed
from streams.materializer import Materializer
from streams.mirror import RedisMirror
from streams.store import TableStore
from streams.tablefeed import Backlog, Part, Progress, TableFeed
from streams.tables import store, view_store
from streams.topics import SHAPES, TABLES, VIEWS, changes, schemas, table_topics, writer
from streams.writer import Pending
from tables.errors import FatalError
from tables.kafka import bounds, reader
from tables.registry import Registry
from tables.wire import (
    HEADER_ERROR,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    UndecodableMessage,
    avro_body,
    schema_id,
)

log = logging.getLogger("headwater.streams")
T = TypeVar("T")
OPS = frozenset({*STREAMED, "READ", "SNAPSHOT_END"})


class Runtime:
    """The fan-out's state between batches; reloaded from Kafka after a rebalance.

    Batches are written without waiting; a checkpoint is written for the newest batch
    Kafka acknowledged with all before it, and a (re)started fan-out reads from it. Only
    the fan-out's feed thread calls ``resume``, ``handle`` and ``tick``.
    """

    def __init__(self) -> None:
        self.fanout: FanOut | None = None
        self.cursor = Cursor(cfg.changes_topic, "fan-out", lambda: writer.low_watermark(cfg.changes_topic))
        self.saved = -1  # raw offset of the last checkpoint written
        self.warned: set[str] = set()
        self.batches = 0
        self.busy = 0.0  # seconds spent handling batches since the last report
        self.reported = (time.monotonic(), 0)

    def load(self) -> FanOut:
        saved = writer.checkpoint()
        start, watermark = saved if saved else (0, (-1, -1))
        self.cursor.reset(start)
        self.saved = start
        topics = [t.topic for t in TABLES] + [cfg.dlq_topic]
        keys = KeyOfRow(schemas)
        self.fanout = FanOut(cfg.partitions, watermark, writer.tails(topics), keys)
        log.info("fan-out resumes: raw offsets below %d done, watermark %s", start, watermark)
        return self.fanout

    def resume(self) -> int:
        """Reload tails and checkpoint (another worker may have written meanwhile): the raw offset to read next."""
        self.load()
        return self.cursor.next

    def handle(self, batch: Sequence[Raw]) -> None:
        """Route and write a batch of raw changes (offset, key, value) in offset order."""
        started = time.monotonic()
        self._handle(batch)
        self.checkpoint()
        self.busy += time.monotonic() - started
        self.batches += 1
        self.report(batch[-1][0])

    def tick(self) -> None:
        """Checkpoint what Kafka acknowledged since the last batch (called while no batch comes)."""
        if self.fanout is not None:
            self.checkpoint()

    def checkpoint(self) -> None:
        done = writer.settle()
        if done is not None and done.end > self.saved:
            writer.save_checkpoint(done.end, done.watermark)
            self.saved = done.end

    def report(self, offset: int, every: float = 10.0) -> None:
        """A progress line every ``every`` seconds: rate, batches, time busy, counters."""
        then, changes = self.reported
        now = time.monotonic()
        if now - then < every or self.fanout is None:
            return
        c = self.fanout.counters
        log.info("fan-out at raw offset %d: %.0f changes/s, %d batches (%.0f%% busy); %s", offset,
                 (c.changes - changes) / (now - then), self.batches, 100 * self.busy / (now - then),
                 ", ".join(f"{k} {v}" for k, v in vars(c).items()))  # fmt: skip
        self.reported, self.batches, self.busy = (now, c.changes), 0, 0.0

    def _handle(self, batch: Sequence[Raw]) -> None:
        fan = self.fanout or self.load()
        pending = writer.open_batch()
        for offset, key, value in self.cursor.admit(batch):
            try:
                change = decode(value)
            except UndecodableMessage as exc:
                self.dead_letter(fan, offset, key, value, str(exc), pending)
                continue
            routed = fan.route(change, offset)
            if isinstance(routed, Truncate):
                self.truncate(fan, routed, pending)
            elif routed:
                self.ensure(routed[0].topic)
                writer.write(routed, pending)
        if fan.unkeyed - self.warned:
            log.warning("tables without key are not fanned out: %s", ", ".join(sorted(fan.unkeyed - self.warned)))
            self.warned |= fan.unkeyed
        pending.end, pending.watermark = self.cursor.next, fan.watermark

    def ensure(self, topic: str) -> None:
        if topic not in writer.known:
            writer.ensure_topics([topic])
            if topic not in {t.topic for t in TABLES}:
                log.warning("new table topic %s: restart the workers to serve it over the endpoint", topic)

    def truncate(self, fan: FanOut, truncate: Truncate, pending: Pending) -> None:
        self.ensure(truncate.topic)
        writer.flush()  # everything before the truncate is on the topic
        keys = live_keys(writer.scan(truncate.topic), truncate.offset)
        writer.write(truncate_outputs(fan, truncate, keys), pending)

    def dead_letter(
        self, fan: FanOut, offset: int, key: bytes | None, value: bytes | None, reason: str, pending: Pending
    ) -> None:
        fan.counters.dead_letters += 1
        log.error("raw message at %s offset %d cannot be decoded (%s): sent to %s",
                  cfg.changes_topic, offset, reason, cfg.dlq_topic)  # fmt: skip
        if fan.fresh(cfg.dlq_topic, 0, (offset, 0)):
            meta = [(HEADER_SOURCE_TOPIC, cfg.changes_topic.encode()), (HEADER_SOURCE_PARTITION, b"0"),
                    (HEADER_SOURCE_OFFSET, b"%d" % offset), (HEADER_ERROR, reason.encode()[:1000])]  # fmt: skip
            writer.produce(cfg.dlq_topic, 0, key, value, headers("DEAD", offset, 0, 0, 0)[1:2] + meta, pending)


class KeyOfRow:
    """The old key of an update under REPLICA IDENTITY FULL: key columns of the old row."""

    def __init__(self, registry: Registry) -> None:
        self.schemas = registry

    def __call__(self, old_row: bytes, new_key: bytes) -> bytes:
        row = self.schemas.decode(old_row)
        key_schema = self.schemas.parsed(schema_id(new_key))
        return new_key[:5] + avro_body(key_schema, {f["name"]: row[f["name"]] for f in key_schema["fields"]})


def decode(value: bytes | None) -> Change:
    if value is None:
        raise UndecodableMessage("empty value")
    record = schemas.decode(value)
    try:
        change = Change.from_record(record)
    except (KeyError, TypeError) as exc:
        raise UndecodableMessage(f"not a change record: missing {exc}") from exc
    if change.op not in OPS:
        raise UndecodableMessage(f"unknown operation {change.op!r}")
    return change


runtime = Runtime()
materializer = Materializer(cfg, VIEWS, SHAPES, view_store, writer, schemas) if VIEWS else None
mirror = RedisMirror(cfg, VIEWS, schemas) if VIEWS and cfg.redis_url != "none" else None


class Owner:
    """The raw topic's feeds, running while this worker owns the raw partition (``streams.feed``)."""

    def __init__(self) -> None:
        self.feeds: list[Feed] = []

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.feeds:
            return
        self.feeds.append(self._feed("fan-out", runtime.resume, runtime.handle, runtime.tick, loop))
        if materializer is not None:
            if mirror is not None and not mirror.is_alive():
                mirror.start()
            self.feeds.append(self._feed("views", materializer.resume, materializer.handle, materializer.idle, loop))
        for feed in self.feeds:
            feed.start()

    def stop(self) -> None:
        """Stop reading; state is reloaded by whoever owns the partition next (maybe this worker)."""
        for feed in self.feeds:
            feed.stop()
        self.feeds.clear()
        runtime.fanout = None
        if materializer is not None:
            materializer.joiner = None

    @staticmethod
    def _feed(name: str, start: Callable[[], int], handle: Callable[[list[Raw]], None], idle: Callable[[], None],
              loop: asyncio.AbstractEventLoop) -> Feed:  # fmt: skip
        def fatal(exc: FatalError) -> None:
            log.error("%s stopped: %s%s", name, exc, f" ({exc.hint})" if exc.hint else "")
            asyncio.run_coroutine_threadsafe(app.crash(exc), loop)

        return Feed(name, cfg.changes_topic, profile.reader_settings(cfg), start=start, handle=handle, idle=idle,
                    on_fatal=fatal, batch_size=cfg.batch_size, wait=cfg.batch_wait)  # fmt: skip



owner = Owner()
RAW = TP(cfg.changes_topic, 0)
TABLE_TOPICS = frozenset(t.topic for t in TABLES)


class Tables:
    """The table feed of the table-topic partitions this worker is assigned (``streams.tablefeed``)."""

    def __init__(self, store: TableStore) -> None:
        self.store = store
        self.feed: TableFeed | None = None

    def start(self, assigned: set[TP], loop: asyncio.AbstractEventLoop) -> None:
        parts = sorted((tp.topic, tp.partition) for tp in assigned if tp.topic in TABLE_TOPICS)
        if self.feed is not None and self.feed.is_alive() and sorted(self.feed.progress) == parts:
            return
        self.stop()
        if not parts:
            return
        if self.store.db is None:
            self.store.open()

        def fatal(exc: FatalError) -> None:
            log.error("tables stopped: %s%s", exc, f" ({exc.hint})" if exc.hint else "")
            asyncio.run_coroutine_threadsafe(app.crash(exc), loop)

        self.feed = TableFeed(self.store, profile.reader_settings(cfg), parts, batch_size=cfg.batch_size,
                              wait=cfg.batch_wait, on_fatal=fatal)  # fmt: skip
        self.feed.start()

    def stop(self) -> None:
        if self.feed is not None:
            self.feed.stop()
            self.feed = None

    def progress(self, part: Part) -> Progress | None:
        """The partition's progress if this worker reads it now (None: not assigned here)."""
        return None if self.feed is None else self.feed.progress.get(part)


tables = Tables(store)


def raw_end() -> int:
    """The raw topic's true end (fetched: the local broker's ListOffsets can answer short)."""
    consumer = reader(profile.reader_settings(cfg))
    try:
        return bounds(consumer, cfg.changes_topic, 0)[1]
    finally:
        consumer.close()


def fanned() -> int:
    """The raw offset the fan-out's checkpoint says it wrote everything below."""
    saved = writer.checkpoint()
    return saved[0] if saved else 0


backlog = Backlog(raw_end, fanned)


@app.on_rebalance_complete.connect  # type: ignore[arg-type]  # mode types the handler too narrowly
async def _rebalanced(sender: Any, *args: Any, **kwargs: Any) -> None:
    """Tables are recovered: the owner of the raw partition starts reading it."""
    assigned = app.consumer.assignment()
    if not backlog.is_alive() and not backlog.done.is_set():
        backlog.start()
    tables.start(assigned, asyncio.get_running_loop())
    if RAW in assigned:
        owner.start(asyncio.get_running_loop())


@app.on_partitions_revoked.connect  # type: ignore[arg-type]
async def _revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
    """Another worker may own the raw partition next: stop reading before the revocation returns."""
    await asyncio.to_thread(owner.stop)
    await asyncio.to_thread(tables.stop)


@app.on_before_shutdown.connect  # type: ignore[arg-type]
async def _shutdown(sender: Any, *args: Any, **kwargs: Any) -> None:
    await asyncio.to_thread(owner.stop)
    await asyncio.to_thread(tables.stop)
    backlog.stopping.set()
    store.close()
    if materializer is not None:
        materializer.close()
    view_store.close()


@app.agent(changes, name="raw")
async def raw(stream: Any) -> None:
    """Holds the raw partition's assignment; Faust delivers nothing here (``App.direct``)."""
    async for event in stream.events():
        log.error("Faust delivered raw offset %d: the fan-out reads the raw topic itself", event.message.offset)


if table_topics is not None:

    @app.agent(table_topics, name="table_rows")
    async def table_rows(stream: Any) -> None:
        """Holds the table topics' assignment; Faust delivers nothing here (``App.direct``)."""
        async for event in stream.events():
            log.error("Faust delivered %s offset %d: the table feed reads the table topics itself",
                      event.message.topic, event.message.offset)  # fmt: skip
