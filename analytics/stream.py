"""Structured Streaming over Headwater topics: ``spark.readStream.format("headwater")``.

Promise: a stream reads one topic (options ``topic``, ``table`` or ``view``, as a batch read)
in ``changes`` mode — the same columns a batch read in that mode has — one micro-batch after
another, from ``startingOffsets`` (``analytics.offsets``: earliest by default). Its offsets
live in the query's checkpoint, so a restarted query goes on after its last committed batch
and a file sink holds every message once. ``maxOffsetsPerTrigger`` bounds a batch;
``trigger(availableNow=True)`` reads what the topic held when the query started, in batches
within that bound, and stops. A view is read cut by cut: every batch ends exactly at a
published cut of the view (the offsets carry the cut's commit LSN), so no batch holds part of
a source transaction, and a bound may make a batch stop at an earlier cut but never between
two (a batch may then exceed it). Offsets are planned on the driver with one Kafka consumer
kept for the query (made on first use, closed by ``stop``); tasks read with
``analytics.reader``. Batch-only options (``mode=latest``, ``cut``) are refused with what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from confluent_kafka import Consumer, KafkaException, TopicPartition
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from analytics.errors import SourceError, SourceUnavailable
from analytics.offsets import (
    EARLIEST,
    LATEST,
    NO_CUT,
    CutAt,
    Position,
    Start,
    admit,
    at_cut,
    next_cut,
    parse_start,
)
from analytics.plan import Request, Slice, number, open_consumer, partitions, split
from analytics.reader import SliceReader
from tables.errors import RetryableError
from tables.kafka import bounds, fetched_ends, read_on
from tables.topics import CUTS_PARTITION, cuts_topic
from tables.views import decode_cut

LIMIT_OPTION = "maxoffsetspertrigger"


def stream_reader(options: Mapping[str, str], slices: SliceReader) -> TopicStream:
    """The stream reader the options ask for: a topic's, or a view's (cut by cut)."""
    req = slices.req
    opts = {k.lower(): v for k, v in options.items()}
    if req.mode != "changes" or req.cut is not None:
        raise SourceError("a stream reads changes: mode 'latest' and 'cut' are for batch reads", topic=req.topic,
                          hint="drop the mode and cut options; to keep the latest row per key, merge each batch "
                               "by key (foreachBatch), or use spark.read for a state at a cut")  # fmt: skip
    limit = number(opts, LIMIT_OPTION, 0, req.topic) if LIMIT_OPTION in opts else None
    start = parse_start(opts.get("startingoffsets"), req.topic, view=req.view is not None)
    kind = ViewStream if req.view is not None else TopicStream
    return kind(req, start, limit, slices)


class TopicStream(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of a topic: each from the last batch's ends to the partitions' true ends (or a bound)."""

    def __init__(self, req: Request, start: Start, limit: int | None, slices: SliceReader) -> None:
        self.req, self.start, self.limit, self.slices = req, start, limit, slices
        self.view = req.view is not None
        self.target: Position | None = None  # availableNow: never past this
        self.latest: Position | None = None
        self._consumer: Consumer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_consumer": None}  # tasks get the reader, not the driver's consumer

    # ---- Spark's calls (its names) ---------------------------------------------------------
    def initialOffset(self) -> dict[str, Any]:
        return self._guarded(self.initial).encode()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        at = Position.decode(start, self.req.topic, view=self.view)
        rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return self._guarded(lambda: self.advance(at, rows)).encode()

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadAllAvailable() if self.limit is None else ReadMaxRows(self.limit)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self._guarded(self.newest)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return None if self.latest is None else self.latest.encode()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        first = Position.decode(start, self.req.topic, view=self.view).offsets
        last = Position.decode(end, self.req.topic, view=self.view).offsets
        return [s for p, e in sorted(last.items()) for s in split(self.req.topic, p, first.get(p, 0), e,
                                                                   self.req.task_records)]  # fmt: skip

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, Slice)
        yield from self.slices.read(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: the offsets are Spark's (in its checkpoint), none are committed to Kafka."""

    def stop(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    # ---- offsets ------------------------------------------------------------------------------
    def initial(self) -> Position:
        lows, ends = self._bounds()
        if self.start.kind == "latest":
            return Position(self.req.topic, ends)
        unknown = sorted(set(self.start.offsets) - set(lows))
        if unknown:
            raise SourceError(f"startingOffsets names partition {unknown[0]}, which the topic does not have",
                              topic=self.req.topic, hint=f"its partitions: {sorted(lows)}")  # fmt: skip
        picked = {p: self.start.offsets.get(p, EARLIEST) for p in lows}
        return Position(self.req.topic, {p: {EARLIEST: lows[p], LATEST: ends[p]}.get(o, o) for p, o in picked.items()})

    def newest(self) -> Position:
        return Position(self.req.topic, self._bounds()[1])

    def advance(self, at: Position, limit: int | None) -> Position:
        """Where the next batch ends: the true ends now (or at availableNow's target), within ``limit``."""
        self.latest = self.target or self.newest()
        return Position(self.req.topic, admit(at.offsets, self.latest.offsets, limit))

    def consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = open_consumer(self.req)
        return self._consumer

    def _bounds(self) -> tuple[dict[int, int], dict[int, int]]:
        """(first offset, true end) of every partition of the topic."""
        consumer = self.consumer()
        numbers = partitions(self.req, consumer)
        marks = {p: consumer.get_watermark_offsets(TopicPartition(self.req.topic, p), timeout=15) for p in numbers}
        reported = {(self.req.topic, p): high for p, (_, high) in marks.items()}
        ends = fetched_ends(self.req.kafka, reported, timeout=self.req.timeout)
        return {p: low for p, (low, _) in marks.items()}, {p: ends[(self.req.topic, p)] for p in numbers}

    def _guarded(self, step: Callable[[], Position]) -> Position:
        """``step()``, with Kafka's failures as ``SourceUnavailable`` (the consumer is made anew next time)."""
        try:
            return step()
        except (KafkaException, RetryableError) as exc:
            self.stop()
            raise SourceUnavailable(f"cannot find the stream's offsets: {exc}", topic=self.req.topic) from exc


class ViewStream(TopicStream):
    """Micro-batches of a view topic that each end exactly at one of the view's published cuts."""

    def __init__(self, req: Request, start: Start, limit: int | None, slices: SliceReader) -> None:
        super().__init__(req, start, limit, slices)
        self.seen: list[CutAt] = []  # cuts read from the cuts topic, past the stream's position
        self.read_from = self.read_to = 0  # the cuts-topic offsets ``seen`` covers

    def initial(self) -> Position:
        lows, _ = self._bounds()
        here = Position(self.req.topic, lows, NO_CUT)  # a partition no cut names yet: all of it is after them
        if self.start.kind == "earliest":
            return here
        cuts = self.cuts_after(NO_CUT.next)
        if self.start.kind == "lsn":
            cuts = [c for c in cuts if c.commit_lsn <= self.start.lsn]
        return at_cut(here, max(cuts, key=lambda c: c.commit_lsn)) if cuts else here

    def newest(self) -> Position:
        """availableNow's target: the cuts published so far (up to the cuts topic's end now)."""
        where = cuts_topic(self.req.prefix)
        listed = self.consumer().list_topics(timeout=15).topics
        end = bounds(self.req.kafka, where, CUTS_PARTITION)[1] if where in listed else 0
        return Position(self.req.topic, {}, CutAt(0, {}, end))

    def advance(self, at: Position, limit: int | None) -> Position:
        assert at.cut is not None
        cuts = [c for c in self.cuts_after(at.cut.next) if self.target is None or self._within_target(c)]
        chosen = next_cut(at, cuts, limit)
        if cuts:
            self.latest = at_cut(at, max(cuts, key=lambda c: c.commit_lsn))
        return at if chosen is None else at_cut(at, chosen)

    def _within_target(self, cut: CutAt) -> bool:
        assert self.target is not None and self.target.cut is not None
        return cut.next <= self.target.cut.next

    def cuts_after(self, next_offset: int) -> list[CutAt]:
        """This view's cuts from cuts-topic offset ``next_offset`` on (read once, kept while ahead)."""
        if not self.read_from <= next_offset <= self.read_to:
            self.seen, self.read_from, self.read_to = [], next_offset, next_offset
        self.seen += self._read_cuts()
        self.seen = [c for c in self.seen if c.next > next_offset]
        self.read_from = next_offset
        return list(self.seen)

    def _read_cuts(self) -> list[CutAt]:
        where = cuts_topic(self.req.prefix)
        consumer = self.consumer()
        if where not in consumer.list_topics(timeout=15).topics:
            return []
        found = []
        for msg in read_on(self.req.kafka, {(where, CUTS_PARTITION): self.read_to}, timeout=self.req.timeout):
            self.read_to = int(msg.offset() or 0) + 1
            value = msg.value()
            cut = decode_cut(value) if value is not None else None
            if cut is not None and cut["topic"] == self.req.topic:
                ends = {int(e["partition"]): int(e["offset"]) for e in cut["ends"]}
                found.append(CutAt(int(cut["commit_lsn"]), ends, self.read_to))
        return found
