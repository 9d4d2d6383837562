"""The table topics, read in batches into the table store by the worker that holds their partitions.

Promise: a ``TableFeed`` reads the table-topic partitions Faust assigned to this worker (they
are ``App.direct`` topics: assigned, never delivered by Faust), each from the offset the
``TableStore`` holds, in batches of up to ``batch_size`` messages, and writes each partition's
part of a batch to the store in one write — rows, tombstones and the offset together. A
partition whose stored offset lies outside the topic (compacted or deleted past it, or the
topic was recreated) is read again from its start. Each partition's ``Progress`` — offset
read, end as last fetched, rows — tells the endpoint a key that does not exist (the partition
has read everything its last fetch reported: 404) from one not read yet (503) — ``loaded`` says
whether it was read to its end once since it was assigned (readiness: a partition that gets
records faster than one read is still loaded) — and is logged
every ``report_every`` seconds while a partition is behind, with rate and ETA. The feed
retries what fails with a pause doubling to 30 s (the batch in hand is not skipped); a topic
the broker no longer has is a ``FatalError`` for ``on_fatal``. ``stop`` returns once the batch
in hand is written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from streams.errors import GONE, gone
from streams.fanout import header_lsn
from streams.feed import Follower
from streams.store import Record, TableStore
from tables.errors import FatalError, RetryableError
from tables.kafka import FetchWait, StallWatch, bounds_of, reader

log = logging.getLogger("headwater.streams")
Part = tuple[str, int]  # (table topic, partition)


@dataclass
class Progress:
    """How far one partition was read into the store."""

    offset: int = 0  # next offset to read
    end: int = 0  # the partition's end as the last fetch reported it
    rows: int = 0
    loaded_from: tuple[float, int] = field(default_factory=lambda: (time.monotonic(), 0))  # (when, offset)
    loaded: bool = False  # read to its end at least once since this feed was given the partition
    bounded: bool = True  # its end was asked of the broker (until then, 0 is no end: nothing is known read)

    @property
    def current(self) -> bool:
        """Everything the last fetch reported is in the store (a key it lacks does not exist)."""
        return self.bounded and self.offset >= self.end

    def eta(self) -> float | None:
        """Seconds until ``end`` at the rate read since the feed started, None before any rate is known."""
        then, start = self.loaded_from
        rate = (self.offset - start) / max(time.monotonic() - then, 1e-6)
        return None if rate <= 0 else max(self.end - self.offset, 0) / rate


class TableFeed(Follower):
    what = "the table topics"

    def __init__(self, store: TableStore, settings: Mapping[str, Any], parts: Iterable[Part], *, batch_size: int,
                 wait: float, on_fatal: Callable[[FatalError], None], report_every: float = 10.0) -> None:  # fmt: skip
        super().__init__("tables", on_fatal)
        self.store = store
        self.settings, self.fetch_wait = settings, FetchWait(settings)
        # not current until ``_start`` knows the partition's end: a worker just given a partition answered 404 for
        # keys it had not read yet (a rebalance in CI)
        self.progress: dict[Part, Progress] = {part: Progress(bounded=False) for part in sorted(parts)}
        self.batch_size, self.wait = batch_size, wait
        self.report_every = report_every
        self.reported = time.monotonic()

    def _follow(self) -> None:
        consumer = reader(self.fetch_wait.applied(self.settings))
        try:
            found = bounds_of(self.fetch_wait.applied(self.settings), list(self.progress))
            consumer.assign([TopicPartition(t, p, self._start((t, p), *found[(t, p)])) for t, p in self.progress])
            log.info("%s: reading %d table-topic partitions into %s", self.name, len(self.progress), self.store.path)
            watch = StallWatch(wait=self.fetch_wait)  # behind a known end with nothing: a seek, a new consumer
            while not self.stopping.is_set():
                messages = consumer.consume(self.batch_size, self.wait)
                if self.stopping.is_set():
                    return
                self._apply(consumer, messages)
                self._report()
                if messages:
                    self.progressed = True
                    watch.seen()
                else:
                    watch.check(consumer, {part for part, p in self.progress.items() if not p.current})
        finally:
            consumer.close()

    def _start(self, part: Part, low: int, end: int) -> int:
        """Where to read ``part`` from: the store's offset, or the start if it lies outside ``low``..``end``."""
        topic, partition = part
        offset = self.store.offset(topic, partition)
        if offset < low or offset > end:
            log.warning("%s[%d]: the store read up to offset %d, outside the topic's %d..%d: reading it again",
                        topic, partition, offset, low, end)  # fmt: skip
            self.store.forget(topic, partition)
            offset = low
        rows = self.store.count(topic, partition)
        was = self.progress[(topic, partition)].loaded  # a restarted read (after a failure) keeps it
        self.progress[(topic, partition)] = Progress(
            offset, end, rows, (time.monotonic(), offset), was or offset >= end
        )
        return offset

    def _apply(self, consumer: Consumer, messages: list[Any]) -> None:
        parts: dict[Part, list[Record]] = {}
        for m in messages:
            error = m.error()
            part = (str(m.topic()), int(m.partition() or 0))
            if error is None:
                lsn, position = header_lsn(m.headers())
                parts.setdefault(part, []).append((m.offset(), m.key(), m.value(), lsn, position))
            elif error.code() == KafkaError._PARTITION_EOF:
                self.progress[part].end = self.progress[part].offset
            elif error.code() in GONE:
                raise gone(part[0], error.str())
            else:
                raise RetryableError(f"reading {part[0]}[{part[1]}]: {error}")
        for (topic, partition), records in parts.items():
            progress = self.progress[(topic, partition)]
            next_offset = records[-1][0] + 1
            progress.rows = self.store.apply(topic, partition, records, next_offset)
            progress.offset = next_offset
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
            progress.end = max(progress.end, high, next_offset)
        for p in self.progress.values():  # per batch: once read to its end, loaded for as long as it is held
            p.loaded = p.loaded or p.current

    def _report(self) -> None:
        now = time.monotonic()
        behind = {part: p for part, p in self.progress.items() if not p.current}
        if now - self.reported < self.report_every or not behind:
            return
        self.reported = now
        for (topic, partition), p in behind.items():
            eta = p.eta()
            log.info("tables: %s[%d] at offset %d of %d, %d rows%s", topic, partition, p.offset, p.end, p.rows,
                     "" if eta is None else f", ETA {eta:.0f} s")  # fmt: skip


class Backlog(threading.Thread):
    """Whether the fan-out has written the table topics up to where the raw topic ended when this worker
    started: until then a key missing from the store may simply not be fanned out yet (503, not 404)."""

    def __init__(self, raw_end: Callable[[], int], fanned: Callable[[], int], *, every: float = 1.0) -> None:
        super().__init__(name="headwater-fanout-backlog", daemon=True)
        self.raw_end, self.fanned, self.every = raw_end, fanned, every
        self.target: int | None = None
        self.at = 0
        self.done = threading.Event()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set() and not self.done.is_set():
            try:
                self.target = self.raw_end() if self.target is None else self.target
                self.at = self.fanned()
            except Exception as exc:  # a broker hiccup: asked again
                log.warning("cannot tell how far the fan-out is (%s); asking again", exc)
            if self.target is not None and self.at >= self.target:
                self.done.set()
                log.info("the fan-out reached raw offset %d, the raw topic's end when this worker started", self.target)
                return
            self.stopping.wait(self.every)
