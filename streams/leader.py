"""The raw partition's owner's part in the views: it announces the publication points and makes the cuts.

Promise: runs on the worker that owns the raw partition (the one Faust assigns it), next to the
fan-out. ``Announcer``, after each batch the fan-out reads, writes ``{raw_end, point}`` to
``<prefix>.views.cuts.points`` (``streams.frontier``): the raw topic's end as that fetch reported it
(its high watermark: every offset below it exists), and whether a publication is due
(``streams.frontier.Pace``); when the raw topic goes quiet and the last record asked for no point,
it asks for one as soon as one is due, so the last changes are published without waiting for more
(and again, once the pace's patience ran out, while the last one is not published everywhere: a
worker that left a partition out of its fragment publishes it there). It hands each record to this
worker's views at once too (``tell``; ``streams.frontier.HandOff``), sparing their point a trip
through the broker.
``Assembler`` reads ``<prefix>.views.cuts.fragments`` (from its last ``WINDOW`` records at start: a
new owner finishes the cuts its predecessor was making; on the local broker its fetch wait grows like the
feeds' — ``tables.kafka.StallWatch`` — since the topic only grows there, and a reader whose short wait no longer
lets the broker's listing of the topic's batches reach the end gets nothing: the other workers' fragments, and
so the cuts over their partitions, would wait) and the fragments this worker's own views
hand it in memory (``add``), and writes a view's cut to ``<prefix>.views.cuts`` in the one format
Redis, the endpoint and Spark read (``tables.views.CUT_SCHEMA``) as soon as every partition of the
view has a fragment at one point, and hands each cut to ``on_cut`` too (the Redis mirror beside it,
which then need not read it back from the cuts topic); it tells the pace how long each worker's
publications take. Both write with a producer of their own that lingers for nothing: every
worker's next step waits for these records. ``Subjects`` registers the records' schemas when first needed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import fastavro
from confluent_kafka import Producer, TopicPartition

from streams.clients import reader_settings
from streams.config import StreamsConfig
from streams.feed import Follower
from streams.frontier import FRAGMENT_SCHEMA, POINT_SCHEMA, Assembly, Cut, Pace, point_value, read_fragment
from streams.writer import produce
from tables.errors import FatalError
from tables.kafka import FetchWait, StallWatch, bounds, read_on, reader
from tables.registry import Registry
from tables.topics import CUTS_PARTITION
from tables.views import CUT_PARSED, CUT_SCHEMA, decode_cut, last_cuts_start
from tables.wire import HEADER_LSN, avro_body, frame

log = logging.getLogger("headwater.streams")
KEY_STRING = fastavro.parse_schema("string")
WINDOW = 2000  # fragments a new owner reads back
Fatal = Callable[[FatalError], None]


class Subjects:
    """The Confluent frames of the views' coordination records, each schema registered when first needed."""

    def __init__(self, cfg: StreamsConfig) -> None:
        self.cfg = cfg
        self.frames: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def frame(self, subject: str, schema: Any) -> bytes:
        with self.lock:
            found = self.frames.get(subject)
            if found is None:
                registry = Registry(self.cfg.registry_url, setting="registry_url in [pipeline] or [streams]")
                found = self.frames[subject] = frame(registry.register(subject, schema))
            return found

    def point(self) -> bytes:
        return self.frame(f"{self.cfg.points_topic}-value", POINT_SCHEMA)

    def fragment(self) -> bytes:
        return self.frame(f"{self.cfg.fragments_topic}-value", FRAGMENT_SCHEMA)

    def cut(self) -> tuple[bytes, bytes]:
        """The cut record's value and key frames."""
        return (self.frame(f"{self.cfg.cuts_topic}-value", CUT_SCHEMA),
                self.frame(f"{self.cfg.cuts_topic}-key", "string"))  # fmt: skip


def coordination_producer(settings: dict[str, Any]) -> Producer:
    """The producer of points and cuts: idempotent, acks=all, and no linger (the workers wait for them)."""
    return Producer({**settings, "linger.ms": 0})


class Announcer:
    """Writes the raw topic's end after each batch the fan-out reads, with whether views publish there
    (module promise); it rides on the fan-out's reader, whose fetches tell the raw topic's end."""

    def __init__(self, cfg: StreamsConfig, producer: Producer, subjects: Subjects, pace: Pace, writer: str,
                 tell: Callable[[bytes], None] | None = None) -> None:  # fmt: skip
        self.cfg, self.producer, self.subjects, self.pace, self.writer = cfg, producer, subjects, pace, writer
        self.tell = tell  # this worker's views, handed each record at once (``streams.frontier.HandOff``)
        self.end = 0  # the raw topic's end as last announced
        self.asked = False  # whether the last record asked for a point

    def saw(self, end: int) -> None:
        """The raw topic ends at ``end`` (the high watermark of the fan-out's last fetch: every offset below
        it exists): announce it when it moved; when it did not and no point was asked for, or the last was
        not published everywhere (a partition left out, ``streams.cuts``), ask for one as soon as one is due."""
        if end > self.end:
            self.end = end
            self.announce(end, None)
        elif end > 0 and (not self.asked or self.pace.pending is not None) and self.pace.due(time.monotonic()):
            self.announce(self.end, True)
        self.producer.poll(0)

    def announce(self, end: int, point: bool | None) -> None:
        """Write ``{raw_end: end, point}``; ``point`` None: whether one is due."""
        now = time.monotonic()
        point = self.pace.due(now) if point is None else point
        value = point_value(self.subjects.point(), end, point, self.writer)
        produce(self.producer, self.cfg.points_topic, 0, None, value, [])
        if self.tell is not None:
            self.tell(value)
        if point:
            self._late(now)
            self.pace.point(now, end)
        self.asked = point

    def _late(self, now: float) -> None:
        """A point asked for while the last is not published everywhere (its patience ran out): which parts held it
        back, and how long. The cuts of their views waited that long (the workers holding them are gone, replaying,
        or their fragments did not come)."""
        missing = self.pace.missing()
        if missing:
            log.warning("views: the point at raw offset %d was not published by %s within %.1f s; the next one is "
                        "asked for without them", self.pace.pending, ", ".join(f"{v}[{p}]" for v, p in missing),
                        now - self.pace.announced)  # fmt: skip


class Assembler(Follower):
    """Makes each view's cut of the workers' fragments (see the module promise)."""

    def __init__(self, cfg: StreamsConfig, producer: Producer, subjects: Subjects, pace: Pace,
                 views: dict[str, str], on_fatal: Fatal) -> None:  # fmt: skip
        super().__init__("cuts", on_fatal)
        self.cfg, self.producer, self.subjects, self.pace, self.views = cfg, producer, subjects, pace, views
        self.assembly = Assembly(views, cfg.partitions)
        self.lock = threading.Lock()  # the feed thread of this worker's views adds fragments too
        self.on_cut: Callable[[dict[str, Any]], None] | None = None  # each cut made, as decode_cut reads it
        self.fetch_wait = FetchWait(reader_settings(cfg, follows=True))  # grown, like the feeds', on the local broker
        self.position: int | None = None  # the next fragment to read, once reading

    def add(self, writer: str, lsn: int, offset: int, seconds: float, ends: list[tuple[str, int, int]]) -> None:
        """A fragment: ``ends`` (view, partition, end offset) published by ``writer`` at ``lsn``, raw ``offset``."""
        with self.lock:
            self.pace.report(writer, seconds, time.monotonic())
            self.pace.published(offset, [(view, partition) for view, partition, _ in ends])
            for view, partition, end in ends:
                self.assembly.add(view, lsn, partition, end)
            for cut in self.assembly.cuts():
                self._publish(cut)

    def last(self) -> int | None:
        """The oldest of the views' last cuts (None before every view has one)."""
        with self.lock:
            lsns = list(self.assembly.last.values())
        return None if not lsns or min(lsns) < 0 else min(lsns)

    def _follow(self) -> None:
        """Read the fragments on from where the last reader stood (at first: the cuts so far, then the last
        ``WINDOW`` fragments), replaced like the feeds' readers when it stalls below the known end."""
        consumer = reader(self.fetch_wait.applied(reader_settings(self.cfg, follows=True)))
        try:
            if self.position is None:
                self._read_cuts()
                low, end = bounds(reader_settings(self.cfg), self.cfg.fragments_topic, 0)
                self.position = max(low, end - WINDOW)
            consumer.assign([TopicPartition(self.cfg.fragments_topic, 0, self.position)])
            watch = StallWatch(wait=self.fetch_wait)
            while not self.stopping.is_set():
                messages = consumer.consume(1000, self.cfg.batch_wait)
                for msg in messages:
                    self._fragment(msg)
                if messages:
                    watch.seen()
                else:
                    watch.check(consumer, {(self.cfg.fragments_topic, 0)})
                self.producer.poll(0)
        finally:
            consumer.close()

    def _fragment(self, msg: Any) -> None:
        value = msg.value() if msg.error() is None else None
        if value is None:
            return
        found = read_fragment(value)
        ends = [(p["view"], p["partition"], p["offset"]) for p in found["parts"]]
        self.add(found["writer"], found["commit_lsn"], found["raw_offset"], found["publish_seconds"], ends)
        self.position = msg.offset() + 1

    def _read_cuts(self) -> None:
        """The cuts published so far (the last records of the cuts topic): cuts never go back."""
        low, end = bounds(reader_settings(self.cfg), self.cfg.cuts_topic, CUTS_PARTITION)
        start = {(self.cfg.cuts_topic, CUTS_PARTITION): last_cuts_start(low, end, len(self.views))}
        for msg in read_on(reader_settings(self.cfg), start, timeout=60):
            value = msg.value()
            if value is not None:
                cut = decode_cut(value)
                with self.lock:
                    self.assembly.seen(cut["view"], cut["commit_lsn"])

    def _publish(self, cut: Cut) -> None:
        value_frame, key_frame = self.subjects.cut()
        ends = [{"partition": p, "offset": o} for p, o in sorted(cut.ends.items())]
        record = {"view": cut.view, "commit_lsn": cut.lsn, "topic": self.views[cut.view], "ends": ends}
        value = value_frame + avro_body(CUT_PARSED, record)
        key = key_frame + avro_body(KEY_STRING, cut.view)
        produce(self.producer, self.cfg.cuts_topic, CUTS_PARTITION, key, value, [(HEADER_LSN, b"%d" % cut.lsn)])
        self.producer.poll(0)
        hook = self.on_cut  # (unhooked by another thread when this worker stops owning the raw partition)
        if hook is not None:
            hook(record)
