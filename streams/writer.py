"""The fan-out's Kafka side: topics, the librdkafka producer, tails and the checkpoint.

Promise: ``ensure_topics`` creates each table topic compacted with the configured
partitions (an existing one with another partition count is refused, naming it);
records are written by an idempotent producer (acks=all, never timed out: a broker
outage stalls, it does not lose), in the order given per partition, without waiting:
each record belongs to a ``Pending`` batch, and ``settle`` says up to which raw offset
every batch before it was acknowledged — the only progress a checkpoint may claim.
``flush`` returns once Kafka acknowledged everything sent. ``tails`` reads the position of each
partition's last record and ``checkpoint`` the fan-out's last saved progress (with the id of the
raw topic it is in; decoded by the schema that wrote it, so older checkpoints read too) — both by
fetching to partition EOF, which is right on Tansu and on real Kafka. ``tails`` also sets where each
partition ends (``Landed``): every acknowledged record must land there, one after another, so records
another writer put among this writer's are found (``Landed.take``) and read back (``records``, ``raw``); the
checkpoint carries how far each partition was examined (``Landed.verified``), and the next writer takes what lies
past it as found (``Landed.unexamined``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import closing
from typing import Any, NamedTuple, cast

import fastavro
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from streams import clients
from streams.config import StreamsConfig
from streams.errors import TopicLayoutError, refused
from streams.fanout import Output, Position, header_position
from tables.errors import FatalError, RetryableError
from tables.kafka import Record, create_topics, partition_counts, read_on, reader, record, topic_ids
from tables.registry import Registry
from tables.wire import avro_body, frame

log = logging.getLogger("headwater.streams")

CHECKPOINT_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "FanoutCheckpoint",
    "namespace": "headwater",
    "doc": "Every raw-topic record below raw_offset is written to the table topics.",
    "fields": [
        {"name": "raw_offset", "type": "long"},
        {"name": "commit_lsn", "type": "long", "doc": "watermark: highest streamed change seen below raw_offset"},
        {"name": "position", "type": "int"},
        {"name": "raw_topic_id", "type": "string", "default": "",
         "doc": "Kafka's id of the raw topic raw_offset is in ('': not known, not checked)"},
        {"name": "verified", "type": {"type": "map", "values": {"type": "array", "items": "long"}}, "default": {},
         "doc": "table topic -> each partition's offset up to which the writer found no record another writer put "
                "there that it had not written over (-1: not known); the next writer examines what lies past it"},
        {"name": "key_schemas", "type": {"type": "map", "values": "long"}, "default": {},
         "doc": "table topic -> the key schema id its records below raw_offset are keyed with; a change keyed with "
                "another moves the topic's rows to it (streams.fanout.Rekey)"},
    ],
}
CHECKPOINT_PARSED = fastavro.parse_schema(CHECKPOINT_SCHEMA)


class Checkpoint(NamedTuple):
    """The fan-out's saved progress: raw offsets below ``raw_offset`` are written, in ``raw_topic_id``'s topic."""

    raw_offset: int
    watermark: tuple[int, int]
    raw_topic_id: str
    verified: dict[tuple[str, int], int]  # (topic, partition) -> offset; see ``Landed.verified``
    key_schemas: dict[str, int]  # table topic -> the key schema id of its records (``streams.fanout.Rekey``)
Scanned = tuple[bytes | None, bytes | None, Position | None]


def produce(producer: Producer, topic: str, partition: int, key: bytes | None, value: bytes | None,
            headers: list[tuple[str, bytes]], callback: Any = None) -> None:  # fmt: skip
    """Hand one record to librdkafka, waiting for room while its queue is full."""
    while True:
        try:
            producer.produce(topic, value, key, partition=partition, headers=cast(Any, headers), on_delivery=callback)
            return
        except BufferError:
            producer.poll(0.05)  # the queue is full: let deliveries drain it


class Stray(NamedTuple):
    """Offsets ``start`` up to ``end`` of a partition hold records this writer did not write (``end`` -1: up to
    the partition's end, records found past this writer's last one); ``handed``: records written after the last
    writer's verified offset (its own last ones, maybe another's), examined by the next writer."""

    topic: str
    partition: int
    start: int
    end: int
    handed: bool = False


class Landed:
    """Each watched partition's end as this writer knows it, moved on by every record Kafka acknowledges.

    Kafka reports a partition's deliveries in order, and only this writer writes the partition: each
    record lands where the last one ended. One that lands further on has another writer's records before
    it (a zombie: a worker paused past its session, sending old records before it notices it lost the raw
    partition); those offsets are kept as a ``Stray`` until ``take``, and until the records written over them
    are acknowledged (``release``) ``verified`` stays before them. Pure: the writer feeds it.
    """

    def __init__(self) -> None:
        self.ends: dict[tuple[str, int], int] = {}
        self.watched: frozenset[str] = frozenset()
        self.found: list[Stray] = []
        self.mending: list[Stray] = []  # taken; what was written over them not acknowledged yet
        self.frozen: dict[tuple[str, int], tuple[int, int]] = {}  # vouched for only up to here, until a raw offset

    def expect(self, ends: dict[tuple[str, int], int], topics: Iterable[str]) -> None:
        """Start ``topics`` over from their partitions' ``ends`` (read just now); partitions not in ``ends``
        start where their first acknowledged record lands."""
        topics = frozenset(topics)
        self.ends = {at: end for at, end in self.ends.items() if at[0] not in topics} | ends
        self.found = [s for s in self.found if s.topic not in topics]
        self.mending = [s for s in self.mending if s.topic not in topics]
        self.frozen = {at: end for at, end in self.frozen.items() if at[0] not in topics}
        self.watched |= topics

    def unexamined(self, verified: dict[tuple[str, int], int]) -> None:
        """Past the last writer's ``verified`` offsets lie records nobody examined: strays to examine."""
        for at, start in sorted(verified.items()):
            end = self.ends.get(at, -1)
            if at[0] in self.watched and 0 <= start < end:
                self.found.append(Stray(at[0], at[1], start, end, handed=True))

    def landed(self, topic: str, partition: int, offset: int) -> None:
        at = (topic, partition)
        if self.ends.get(at) == offset:  # the usual case, once a record per partition and delivery: kept short
            self.ends[at] = offset + 1
        else:
            self._elsewhere(at, offset)

    def _elsewhere(self, at: tuple[str, int], offset: int) -> None:
        end = self.ends.get(at)
        if end is None and at[0] not in self.watched:
            return
        if end is not None and offset > end:
            self.found.append(Stray(at[0], at[1], end, offset))
        self.ends[at] = max(end or 0, offset + 1)

    def tail(self, topic: str, partition: int, end: int) -> None:
        """The partition's end as Kafka reports it while nothing of this writer's is in flight: past this writer's
        last record, another writer's records lie at its tail."""
        known = self.ends.get((topic, partition))
        if known is not None and end > known and Stray(topic, partition, known, -1) not in self.found:
            self.found.append(Stray(topic, partition, known, -1))

    def reach(self, topic: str, partition: int, end: int) -> None:
        """Records up to ``end`` were read back: this writer's next one lands there."""
        self.ends[(topic, partition)] = max(self.ends.get((topic, partition), 0), end)

    def take(self) -> list[Stray]:
        found, self.found = self.found, []
        self.mending += found
        return found

    def release(self, strays: Iterable[Stray]) -> None:
        """What was written over ``strays`` is acknowledged."""
        for stray in strays:
            if stray in self.mending:
                self.mending.remove(stray)

    def freeze(self, stray: Stray, until: int) -> None:
        """The stray's writer is ahead of this one, up to raw offset ``until`` (this one may be the zombie): from
        the stray's start on, this writer's records are not vouched for (``verified``) until it has itself written
        every change up to there after them (``thaw``), which leaves each key's newest record its own."""
        at = (stray.topic, stray.partition)
        start, upto = self.frozen.get(at, (stray.start, until))
        self.frozen[at] = (min(start, stray.start), max(upto, until))

    def thaw(self, written: int) -> None:
        """Every raw offset below ``written`` is written by this writer and acknowledged."""
        if self.frozen:
            self.frozen = {at: f for at, f in self.frozen.items() if f[1] >= written}

    def verified(self) -> dict[tuple[str, int], int]:
        """Each partition's offset up to which nothing another writer put there is left unexamined or unmended."""
        out = dict(self.ends)
        held = [((s.topic, s.partition), s.start) for s in (*self.found, *self.mending)]
        for at, start in [*held, *((at, f[0]) for at, f in self.frozen.items())]:
            out[at] = min(out.get(at, start), start)
        return out


class Pending:
    """The records written for a run of raw offsets, counted down as Kafka acknowledges them."""

    __slots__ = ("end", "failed", "failed_topic", "frames", "landed", "outstanding", "strays", "watermark")

    def __init__(self, landed: Landed | None = None) -> None:
        self.end = -1  # raw offset after the last one handled; -1 while still being written
        self.watermark = (-1, -1)
        self.frames: dict[str, bytes] = {}  # the fan-out's key frames per table topic at ``end``
        self.outstanding = 0
        self.failed: KafkaError | None = None
        self.failed_topic = ""  # where the refused record went
        self.landed = landed
        self.strays: tuple[Stray, ...] = ()  # what this batch writes over (``FanOutRun.mend``)

    def delivered(self, error: KafkaError | None, msg: Any) -> None:
        self.outstanding -= 1
        if error is not None:
            self.failed, self.failed_topic = error, str(msg.topic())
        elif self.landed is not None:
            self.landed.landed(msg.topic(), msg.partition(), msg.offset())


class TableWriter:
    """Writes fan-out records, dead letters and checkpoints; reads tails back."""

    def __init__(self, cfg: StreamsConfig) -> None:
        self.cfg = cfg
        self.producer = Producer(clients.producer_settings(cfg))
        self.ledger: deque[Pending] = deque()
        self.admin = AdminClient(clients.kafka_client(cfg))
        self.known: dict[str, int] = {}  # topic -> partitions, checked or created
        self.checkpoint_frame: bytes | None = None
        self.registry: Registry | None = None
        self.landed = Landed()
        self.refused: FatalError | None = None  # a record Kafka refused: no batch after it settles any more

    # ---- topics ---------------------------------------------------------------------
    def ensure_topics(self, topics: Iterable[str], *, partitions: int | None = None, compact: bool = True,
                      config: dict[str, str] | None = None, create: bool = True) -> list[str]:  # fmt: skip
        """Make ``topics`` known (their partitions checked), made where missing unless not ``create``: those known."""
        topics, want = list(topics), partitions or self.cfg.partitions
        todo = [t for t in topics if t not in self.known]
        if todo:
            self._ensure(todo, want, compact, config or {}, create)
        return [t for t in topics if t in self.known]

    def _ensure(self, todo: list[str], want: int, compact: bool, config: dict[str, str], create: bool) -> None:
        try:
            existing = partition_counts(self.admin)
        except KafkaException as exc:
            hint = "start the broker, or set bootstrap in [pipeline] or [streams]"
            raise RetryableError(f"cannot reach Kafka at {self.cfg.bootstrap}: {exc}", hint=hint) from exc
        todo = todo if create else [t for t in todo if t in existing]
        for topic in todo:
            if existing.get(topic, want) != want:
                raise TopicLayoutError(
                    topic, f"has {existing[topic]} partitions, the workers are set for {want}",
                    hint="set [streams] partitions to match, or delete the topic so it is made again",
                )  # fmt: skip
        settings = {"cleanup.policy": "compact" if compact else "delete", **self.cfg.topic_config, **config}
        made = [NewTopic(t, want, self.cfg.replication_factor, config=settings) for t in todo if t not in existing]
        try:
            create_topics(self.admin, made)
        except KafkaException as exc:
            raise FatalError(f"cannot create topics {[t.topic for t in made]}: {exc}") from exc
        for topic in todo:
            self.known[topic] = want
        for new in made:
            log.info("created topic %s (%d partitions, %s)", new.topic, want, "compacted" if compact else "delete")

    # ---- writing --------------------------------------------------------------------
    def open_batch(self) -> Pending:
        pending = Pending(self.landed)
        self.ledger.append(pending)
        return pending

    def produce(self, topic: str, partition: int, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]], pending: Pending | None = None) -> None:  # fmt: skip
        callback = None
        if pending is not None:
            pending.outstanding += 1
            callback = pending.delivered
        produce(self.producer, topic, partition, key, value, headers, callback)

    def write(self, outputs: Iterable[Output], pending: Pending) -> None:
        for o in outputs:
            self.produce(o.topic, o.partition, o.key, o.value, o.headers, pending)

    def settle(self) -> Pending | None:
        """The newest batch that, with every batch before it, Kafka acknowledged (None if none)."""
        self.producer.poll(0)
        done = None
        while self.refused is None and self.ledger and self.ledger[0].end >= 0 and self.ledger[0].outstanding <= 0:
            done = self.ledger.popleft()
            if done.failed is not None:
                self.refused = refused(done.failed, done.failed_topic, "a record",
                                       hint="check the broker log and the topic settings")  # fmt: skip
            self.landed.release(done.strays)
        if self.refused is not None:
            raise self.refused
        if done is not None:
            self.landed.thaw(done.end)
        return done

    def flush(self) -> None:
        """Until Kafka acknowledged everything sent (logging while the broker is away)."""
        started = time.monotonic()
        while self.producer.flush(5.0) > 0:
            log.warning("waiting %.0f s for Kafka to acknowledge %d records", time.monotonic() - started,
                        len(self.producer))  # fmt: skip

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for Kafka to acknowledge what was sent (a warning if it did not)."""
        left = self.producer.flush(timeout)
        if left:
            log.warning("%d table-topic records not acknowledged after %g s: if they land after records written "
                        "from now on, the fan-out writes their keys again", left, timeout)  # fmt: skip

    def save_checkpoint(self, saved: Checkpoint) -> None:
        if self.checkpoint_frame is None:
            self.checkpoint_frame = frame(self._registry().register(f"{self.cfg.progress_topic}-value",
                                                                    CHECKPOINT_SCHEMA))  # fmt: skip
        body = avro_body(CHECKPOINT_PARSED, {"raw_offset": saved.raw_offset, "commit_lsn": saved.watermark[0],
                                             "position": saved.watermark[1], "raw_topic_id": saved.raw_topic_id,
                                             "verified": by_topic(saved.verified),
                                             "key_schemas": saved.key_schemas})  # fmt: skip
        self.produce(self.cfg.progress_topic, 0, self.cfg.changes_topic.encode(), self.checkpoint_frame + body, [])

    # ---- reading back ---------------------------------------------------------------
    def low_watermark(self, topic: str) -> int:
        """The first offset partition 0 of ``topic`` still holds (retention deletes older ones)."""
        consumer = self._consumer()
        try:
            return int(consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[0])
        finally:
            consumer.close()

    def _consumer(self) -> Consumer:
        return reader(clients.reader_settings(self.cfg))

    def _read(self, assignments: list[TopicPartition], timeout: float = 60.0, whole: bool = False) -> Iterator[Record]:
        """``whole``: the read starts far from the end and lasts as long as the caller's work on it: ``timeout`` counts
        from the last batch (``tables.kafka.read_on_batches``' ``bulk`` and ``idle``)."""
        starts = {(a.topic, a.partition): a.offset for a in assignments}
        settings = clients.reader_settings(self.cfg)
        yield from map(record, read_on(settings, starts, timeout=timeout, bulk=whole, idle=whole))

    def _ends(self, topics: Iterable[str], empty: dict[tuple[str, int], int] | None = None) -> list[TopicPartition]:
        """From each partition's reported end minus one (Tansu reports a batch's base + 1); the ends of
        partitions that hold nothing go into ``empty``."""
        consumer = self._consumer()
        try:
            out = []
            for topic in topics:
                for partition in range(self.known.get(topic, 1)):
                    low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
                    if high > low:
                        out.append(TopicPartition(topic, partition, max(low, high - 1)))
                    elif empty is not None:
                        empty[(topic, partition)] = high
            return out
        finally:
            consumer.close()

    def tails(self, topics: Iterable[str]) -> dict[tuple[str, int], Position]:
        """The position written in each partition's last record; where each ends is what ``landed`` expects."""
        topics = list(topics)
        found: dict[tuple[str, int], Position] = {}
        ends: dict[tuple[str, int], int] = {}
        for msg in self._read(self._ends(topics, ends)):
            ends[(msg.topic, msg.partition)] = msg.offset + 1
            at = header_position(msg.headers)
            if at is not None:
                found[(msg.topic, msg.partition)] = at
        self.landed.expect(ends, topics)
        return found

    def records(self, strays: list[Stray]) -> list[list[tuple[bytes | None, Position | None]]]:
        """Key and position of each record of each stray run of offsets (one up to the end: read to it), in one
        read of their partitions; a handed one starts with the record before it, keyless, for its position."""
        starts: dict[tuple[str, int], int] = {}
        for s in strays:
            at, first = (s.topic, s.partition), max(s.start - int(s.handed), 0)
            starts[at] = min(starts.get(at, first), first)
        read: dict[tuple[str, int], list[Record]] = {}
        for r in self._upto(starts, 1 << 62):
            read.setdefault((r.topic, r.partition), []).append(r)
        out = []
        for s in strays:
            first = s.start - int(s.handed)
            mine = [r for r in read.get((s.topic, s.partition), []) if first <= r.offset and (r.offset < s.end
                                                                                                or s.end < 0)]
            if s.end < 0 and mine:
                self.landed.reach(s.topic, s.partition, mine[-1].offset + 1)
            out.append([(r.key if r.offset >= s.start else None, header_position(r.headers)) for r in mine])
        return out

    def look(self) -> bool:
        """Unless a record of this writer's is in flight (False), ask Kafka where each watched partition ends:
        one that ends past this writer's last record has another writer's records at its tail (``Landed.tail``)."""
        if len(self.producer) > 0:
            return False
        ends = self.latest(self.landed.ends)
        for (topic, partition), end in (ends or {}).items():
            self.landed.tail(topic, partition, end)
        return ends is not None

    def latest(self, parts: Iterable[tuple[str, int]], timeout: float = 10.0) -> dict[tuple[str, int], int] | None:
        """Where Kafka says each partition ends (None: Kafka did not answer within ``timeout``; asked again later).
        The local broker answers its last batch's base offset + 1 (one of many records): never past a writer's own
        end."""
        asked = {TopicPartition(topic, partition): OffsetSpec.latest() for topic, partition in parts}
        try:
            answers = self.admin.list_offsets(asked, request_timeout=timeout).items() if asked else ()
            return {(part.topic, part.partition): int(future.result().offset) for part, future in answers}
        except KafkaException as exc:
            log.debug("cannot ask Kafka where %d partitions end now (%s): asking again later", len(asked), exc)
            return None

    def raw(self, start: int, stop: int) -> Iterator[tuple[int, bytes | None, bytes | None]]:
        """The raw topic's records from offset ``start`` up to ``stop``: (offset, key, value)."""
        for r in self._upto({(self.cfg.changes_topic, 0): start}, stop):
            yield r.offset, r.key, r.value

    def _upto(self, starts: dict[tuple[str, int], int], stop: int) -> Iterator[Record]:
        messages = read_on(clients.reader_settings(self.cfg), starts, timeout=120.0)
        with closing(messages):
            for r in map(record, messages):
                if r.offset >= stop:
                    return
                yield r

    def checkpoint(self) -> Checkpoint | None:
        """The last checkpoint (one written before it named the raw topic's id: ''), or None before the first."""
        self.ensure_topics([self.cfg.progress_topic], partitions=1)
        last = None
        for msg in self._read(self._ends([self.cfg.progress_topic])):
            last = msg.value
        if last is None:
            return None
        saved: Any = self._registry().decode(last)  # by the schema that wrote it
        verified = {(topic, p): int(end) for topic, ends in saved.get("verified", {}).items()
                    for p, end in enumerate(ends) if end >= 0}  # fmt: skip
        return Checkpoint(int(saved["raw_offset"]), (int(saved["commit_lsn"]), int(saved["position"])),
                          str(saved.get("raw_topic_id", "")), verified,
                          {str(t): int(i) for t, i in saved.get("key_schemas", {}).items()})  # fmt: skip

    def raw_topic_id(self) -> str:
        """Kafka's id of the raw topic ('' if it has none or does not exist yet)."""
        return topic_ids(self.admin, [self.cfg.changes_topic]).get(self.cfg.changes_topic, "")

    def _registry(self) -> Registry:
        if self.registry is None:
            self.registry = Registry(self.cfg.registry_url, setting="registry_url in [pipeline] or [streams]")
        return self.registry

    def scan(self, topic: str) -> Iterator[Scanned]:
        """Every record of a table topic, one by one: key, value and the position it was written for. Its 60 s count
        from the last batch read, not the start: the caller's work per record counts in the read's time (a re-key of
        1M rows took 47 s of the 60 s a read had), and a broker away for 60 s still ends it."""
        parts = [TopicPartition(topic, p, 0) for p in range(self.known.get(topic, self.cfg.partitions))]
        return ((m.key, m.value, header_position(m.headers)) for m in self._read(parts, whole=True))


def by_topic(verified: dict[tuple[str, int], int]) -> dict[str, list[int]]:
    """``Checkpoint.verified`` as the checkpoint writes it: topic -> offset per partition, -1 where not known."""
    out: dict[str, list[int]] = {}
    for (topic, partition), end in verified.items():
        ends = out.setdefault(topic, [])
        ends.extend([-1] * (partition + 1 - len(ends)))
        ends[partition] = end
    return out
