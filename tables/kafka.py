"""Reading topics back the way any Confluent consumer would: to the end, Avro decoded via the registry.

Promise: ``read_topic`` returns every record of a topic, stopping at partition EOF as
reported by fetches — right on real Kafka and on Tansu, whose ListOffsets is wrong on
multi-record batches while its fetch high watermark is right; ``batches_to_end`` is that
loop for any partitions from any offsets (``read_on_batches`` / ``read_on``: reading on after a stall).
``fetched_ends`` finds partitions' true ends the same way (or, for a partition written to faster than the
fetch wait, an end past the one reported when asked).
``partition_counts`` and ``create_topics`` are the two steps of making sure a topic exists; ``create_topics``
returns once the broker's metadata shows what it made.
``topic_ids`` names each topic's incarnation (Kafka's topic id, KIP-516: a topic deleted and made
again, or made again by a broker that lost its data, has a new one), which local state read from a
topic keeps to tell that topic from a later one of the same name.
``Registry`` decodes Confluent-framed Avro with schemas fetched once per id from the registry;
``avro_body`` / ``read_framed`` encode and read with a schema the caller holds.
``FetchWait`` is a long-lived reader's fetch wait, grown (by ``StallWatch``) when its fetches come back
empty below a known end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, TopicMetadata

from tables.errors import RetryableError

log = logging.getLogger("tables.kafka")
READER_FETCH_WAIT_MS = 10
READER_QUEUE_BACKOFF_MS = 20
CONSUME_BATCH = 500  # messages taken from librdkafka's queue at once by ``batches_to_end``
STALL = 3.0  # seconds without a message, below the known end, before a reader is nudged
DRY = 1.0  # seconds of empty fetches below a known end, since the reader was last at its end, before its wait grows
LOOK_EVERY_S = 0.1  # between two looks at a reader's positions against its known ends (``StallWatch``)
MOST_WAIT_MS = 1000  # the longest fetch wait FetchWait grows to
# The fetch wait a bulk read (``read_on(bulk=True)``: a whole partition, as a worker's read-back of a view partition
# it takes) starts at. Grown from 10 ms, each step costs seconds of empty fetches first: on the local broker one
# partition of 40,000 records read from offset 0 took 9.7 s in 4,000 batches and 61.5 s in 13,334, against 0.50 and
# 0.72 s from 250 ms (``./dev bench brokerfetch``). The price is one wait at the end (the broker holds an empty
# fetch for it): 0.38 s against 0.12 s for 134 batches, so only a partition of more than ``BULK_FROM`` records
# (at most as many batches; 10 ms lists ~4,000 on a quiet machine) is read so: a worker taking 8 small partitions
# paid 2 s, and published nothing meanwhile (a CI leg's revocation test).
BULK_WAIT_MS = 250
BULK_FROM = 2000
ANSWER_S = 2.0  # how long a reader about to grow its wait waits for the broker to answer a ListOffsets
QUICK_S = 0.5  # an answer slower than this came from a broker just back (paused or restarting): not yet a dry time
CREATED_WITHIN_S = 30.0  # how long the broker may take to answer a CreateTopics (``create_topics``)
SHOWN_WITHIN_S = 30.0  # how long a topic just made may take to show in the broker's metadata (``create_topics``)
SHOWN_POLL_S = 0.05  # between two looks at it
END_LOOK_S = 0.5  # between two looks at the reported ends of partitions a read of their ends still waits on


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    topic: str = ""


def partition_counts(admin: AdminClient) -> dict[str, int]:
    """The partition count of every topic Kafka lists (``KafkaException`` if it does not answer)."""
    topics = admin.list_topics(timeout=10).topics
    return {name: len(meta.partitions) for name, meta in topics.items() if meta.error is None}


def create_topics(admin: AdminClient, topics: list[NewTopic]) -> None:
    """Create ``topics`` and return once the broker's metadata shows each with a leader for every partition; one
    that exists by now (made meanwhile elsewhere) is fine, and so is none (no request); else ``KafkaException``, or
    ``RetryableError`` when the broker answered no creation in time or did not serve a topic it made
    (``wait_shown``). Kafka answers CreateTopics once its controller made the topic, and a broker may learn of it a
    moment later: on Apache Kafka 3.6 (KRaft, one node) a reader asking for a new topic's offsets right after failed
    in 13 of 160 tries, and a stream worker's first start failed with "Unknown partition" reading a topic it had just
    made (bench/RESULTS.md, "On Apache Kafka over 120 s")."""
    if not topics:
        return
    for future in admin.create_topics(topics).values():
        try:
            future.result(timeout=CREATED_WITHIN_S)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
        except TimeoutError as exc:
            raise RetryableError(f"the broker answered no creation of {[t.topic for t in topics]} within "
                                 f"{CREATED_WITHIN_S:g} s", hint="check that the broker's controller is up (its log)",
                                 ) from exc  # fmt: skip
    wait_shown(lambda: admin.list_topics(timeout=10).topics, [t.topic for t in topics])


def wait_shown(look: Callable[[], Mapping[str, TopicMetadata]], names: Collection[str], *,
               within: float = SHOWN_WITHIN_S, sleep: Callable[[float], None] = time.sleep,
               clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
    """Until the metadata ``look`` gives shows every one of ``names`` with its leaders (``unshown``): a
    ``RetryableError`` naming those still missing at the first look after ``within`` seconds (the topics exist: a
    later try finds them); what ``look`` raises (the broker not answering) goes through."""
    deadline = clock() + within
    while waiting := unshown(look(), names):
        if clock() >= deadline:
            raise RetryableError(f"topics {waiting} were made, but the broker did not serve them (a leader for every "
                                 f"partition) within {within:g} s",
                                 hint="check the broker's log; a later try finds them made")  # fmt: skip
        sleep(SHOWN_POLL_S)


def unshown(listed: Mapping[str, TopicMetadata], names: Collection[str]) -> list[str]:
    """Those of ``names`` the metadata ``listed`` does not show, or shows without a leader for some partition."""
    def shown(meta: TopicMetadata | None) -> bool:
        return (meta is not None and meta.error is None and bool(meta.partitions)
                and all(p.leader >= 0 and p.error is None for p in meta.partitions.values()))

    return [name for name in names if not shown(listed.get(name))]


def topic_ids(admin: AdminClient, topics: Collection[str]) -> dict[str, str]:
    """Kafka's id of each of ``topics`` that exists and has one (a broker before 2.8 gives none), as text."""
    found: dict[str, str] = {}
    if not topics:
        return found
    for name, future in admin.describe_topics(TopicCollection(sorted(topics)), request_timeout=30).items():
        try:
            uuid = future.result(timeout=30).topic_id
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue
            raise
        if uuid is not None and (uuid.get_most_significant_bits() or uuid.get_least_significant_bits()):
            found[name] = str(uuid)
    return found


def reader(settings: Mapping[str, Any]) -> Consumer:
    """A consumer that reports partition EOF and commits nothing (a group of its own). Fetches wait
    at most ``READER_FETCH_WAIT_MS`` unless ``settings`` say otherwise: the local broker holds a fetch
    for its whole wait and returns a few batches, so librdkafka's 500 ms read a busy raw topic at
    ~550 messages/s — slower than capture wrote it, and the end was never reached. A full queue is
    looked at again after ``READER_QUEUE_BACKOFF_MS``, not librdkafka's 1 s (``fetch.queue.backoff.ms``):
    a fetch of lz4 batches (capture's raw topic) fills the queue past ``queued.min.messages`` nearly
    every time, and with 1 s a reader took 7-9 s for 1M raw changes on Tansu, 0.5 s with 20 ms."""
    return Consumer({
        "fetch.wait.max.ms": READER_FETCH_WAIT_MS, "fetch.queue.backoff.ms": READER_QUEUE_BACKOFF_MS,
        **settings, "group.id": f"headwater-reader-{time.monotonic_ns()}", "enable.auto.commit": False,
        "enable.partition.eof": True, "auto.offset.reset": "earliest",
    })  # fmt: skip


def batches_to_end(consumer: Consumer, assignments: list[TopicPartition], *, timeout: float,
                   wait: FetchWait | None = None, idle: bool = False,
                   waiting: set[tuple[str, int]] | None = None) -> Iterator[list[Message]]:  # fmt: skip
    """Messages of the assigned partitions, each from its offset to the partition EOF fetches report, in batches:
    lists of messages (none an error), in order. Taken in batches of what librdkafka holds already
    (``consume(n, 0)``), waiting (up to 0.5 s) only for one when it holds none: measured on Tansu, 1M messages
    read in 1.0 s, against 6.4-7.2 s by ``poll`` (one call, and one GIL round, a message). ``Stalled`` when the
    reader stalls (with ``wait``, the consumer's fetch wait, grown first if its fetches came back empty below the
    end): ``read_on_batches`` reads on. ``idle``: ``timeout`` counts from the last batch taken, not the start (a
    read as long as the caller's work on it). ``waiting``: the partitions whose EOF the read still waits for (all
    assigned ones when None), taken off as their EOFs come; the caller may take one off between two batches (an end
    it found otherwise), and the read ends once none is left."""
    if not assignments:
        return
    consumer.assign(assignments)
    waiting = {(a.topic, a.partition) for a in assignments} if waiting is None else waiting
    deadline = time.monotonic() + timeout
    watch = StallWatch(until_eof=True, wait=wait)
    while waiting:
        if time.monotonic() > deadline:
            raise RetryableError(f"no end of {sorted(waiting)} within {timeout:.0f} s")
        batch = consumer.consume(CONSUME_BATCH, 0) or consumer.consume(1, 0.5)
        if not batch:
            watch.check(consumer, waiting)
            continue
        watch.seen()
        taken = _taken(batch, waiting)
        if taken:
            yield taken
            if idle:
                deadline = time.monotonic() + timeout


def _taken(batch: list[Message], waiting: set[tuple[str, int]]) -> list[Message]:
    """The messages of ``batch`` up to the last EOF ``waiting`` waits for (each EOF taken off it); an error other
    than EOF raises ``RetryableError``."""
    taken = []
    for msg in batch:
        error = msg.error()
        if error is None:
            taken.append(msg)
        elif error.code() != KafkaError._PARTITION_EOF:
            raise RetryableError(f"reading {msg.topic()}: {error}")
        else:
            waiting.discard((msg.topic(), msg.partition()))
            if not waiting:
                break
    return taken


class Stalled(RetryableError):
    """A reader delivered nothing below an end it knows, even after a seek: read again with a new consumer."""


class FetchWait:
    """The fetch wait (``fetch.wait.max.ms``) a long-lived reader's next consumer gets, doubled by ``grow``.

    Why it grows, measured (``./dev bench brokerfetch``): the local broker (Tansu 0.6.0's memory engine)
    lists a partition's batches in offset order for every fetch and stops listing when the fetch's wait
    is up; a reader whose offset the listing does not reach in time gets nothing, even at the tail. The
    listing reaches further the longer the wait: at 10 ms about 5,000 batches on this machine, fewer on a
    busy one, and a local stack's partitions only grow. A longer wait costs latency at the tail (the
    broker holds an empty fetch for its whole wait), so a reader starts short and ``StallWatch`` doubles
    it, up to ``MOST_WAIT_MS``, once fetches come back empty below the end they report. ``settings``
    without a fetch wait (librdkafka's default, a real Kafka's long poll) never grow."""

    def __init__(self, settings: Mapping[str, Any], least: int = 0) -> None:
        wait = settings.get("fetch.wait.max.ms")
        self.ms: int | None = None if wait is None else max(int(wait), least)

    def applied(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """``settings`` with the wait as it stands now."""
        return {**settings} if self.ms is None else {**settings, "fetch.wait.max.ms": self.ms}

    def can_grow(self) -> bool:
        return self.ms is not None and self.ms < MOST_WAIT_MS

    def grow(self) -> bool:
        """Double the wait (up to ``MOST_WAIT_MS``); False when it cannot grow."""
        if self.ms is None or not self.can_grow():
            return False
        self.ms = min(self.ms * 2, MOST_WAIT_MS)
        return True


class StallWatch:
    """Notices a reader stuck below a partition's known end: after ``STALL`` s without a message it
    ``nudge``s the reader; after another ``STALL`` s it raises ``Stalled`` (a new consumer reads on).
    ``until_eof``: the reader waits for partition EOF, so any silence that long is a stall, whatever
    the (cached, possibly stale) high watermark says. With a ``wait``, empty reads below the known end
    are timed from when the reader was last at its end (messages read meanwhile do not reset it: on a
    long partition a short wait lets a fetch through now and then); past ``DRY`` seconds the wait grows
    and ``Stalled`` asks for a new consumer with it — if the broker answers: silence from a broker paused
    or restarting is not an empty fetch (the dry time starts again, the wait stays), nor is an answer slower
    than ``QUICK_S``, and the first dry time after a silence, which may hold some of it, is timed again from
    when the broker answered (unless the reader reached its end meanwhile). The reader's positions are looked
    at no more than every ``LOOK_EVERY_S`` (the empty reads between two looks count as one stretch): a look
    holds the GIL in librdkafka's calls, mostly waiting rather than computing, and looking at every empty read
    of a 5 ms wait held it for 15-42% of the GIL time of the worker's fan-out, views and table feeds under the
    views benchmark at 1,000 transactions/s (py-spy --gil, 2026-11-30: the worker's samples holding the GIL
    fell by 19%; its CPU did not change)."""

    def __init__(self, *, until_eof: bool = False, wait: FetchWait | None = None) -> None:
        self.last = self.polled = time.monotonic()
        self.looked = -LOOK_EVERY_S  # the first empty read looks
        self.nudged = False
        self.until_eof = until_eof
        self.wait, self.dry, self.unlooked = wait, 0.0, 0.0
        self.silent = False  # the broker did not answer the last look: the dry time since may be its silence

    def seen(self) -> None:
        self.last = self.polled = time.monotonic()
        self.nudged = False

    def check(self, consumer: Consumer, parts: set[tuple[str, int]]) -> None:
        if self.wait is not None and self.wait.ms is not None:  # a wait that can grow: watch for empty fetches
            self._dry(consumer, parts)
        if time.monotonic() - self.last <= STALL:
            return
        if self.nudged:
            raise Stalled(f"reading {sorted(parts)} stalled below the known end")
        self.nudged = nudge(consumer, parts, force=self.until_eof) or self.until_eof
        self.last = time.monotonic()

    def _dry(self, consumer: Consumer, parts: set[tuple[str, int]]) -> None:
        now = time.monotonic()
        self.unlooked += min(now - self.polled, 0.5)  # empty-read time the next look counts as dry or not
        self.polled = now
        if now - self.looked < LOOK_EVERY_S:
            return
        self.looked = now
        late = behind(consumer, parts)
        self.dry, self.unlooked = (self.dry + self.unlooked if late else 0.0), 0.0
        self.silent = self.silent and bool(late)  # at its end: a silence lies behind the reader
        if self.dry < DRY or self.wait is None or not self.wait.can_grow():
            return
        asked = time.monotonic()
        answered = answers(consumer, late[0]) and time.monotonic() - asked < QUICK_S  # a slow answer: a broker back
        if not answered or self.silent:  # the broker's silence (its other signs are logged elsewhere), or its end
            log.debug("fetches of %s %s: the fetch wait stays %s ms", sorted(parts),
                      "answered again" if answered else "not answered", self.wait.ms)  # fmt: skip
            self.dry, self.silent = 0.0, not answered
            return
        self.wait.grow()
        raise Stalled(f"fetches of {sorted(parts)} came back empty below the known end for {self.dry:.1f} s; "
                      f"the broker lists a partition's batches within a fetch's wait: {self.wait.ms} ms now")


def answers(consumer: Consumer, tp: TopicPartition) -> bool:
    """Whether the broker answers a ListOffsets for ``tp`` within ``ANSWER_S`` (on the consumer's own connections,
    which its fetches use too)."""
    try:
        consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=ANSWER_S, cached=False)
    except KafkaException:
        return False
    return True


def behind(consumer: Consumer, parts: set[tuple[str, int]]) -> list[TopicPartition]:
    """Each of ``parts`` whose position (the offset it was assigned at, before it delivered anything) is
    below the high watermark the last fetch reported."""
    assigned = {(tp.topic, tp.partition): tp.offset for tp in consumer.assignment()}
    late = []
    for tp in consumer.position([TopicPartition(t, p) for t, p in sorted(parts)]):
        at = tp.offset if tp.offset >= 0 else assigned.get((tp.topic, tp.partition), -1)
        if 0 <= at < consumer.get_watermark_offsets(tp, cached=True)[1]:
            late.append(TopicPartition(tp.topic, tp.partition, at))
    return late


def nudge(consumer: Consumer, parts: set[tuple[str, int]], *, force: bool = False) -> bool:
    """Seek each of ``parts`` that is behind its known end (each with a position, when ``force``) to
    where it stands: librdkafka fetches it afresh. On the local broker a reader sometimes stops short
    of the end it knows (position below the high watermark, nothing delivered, while a new reader at
    that offset reads on); a seek gets it going again. True if any was sought."""
    late = consumer.position([TopicPartition(t, p) for t, p in sorted(parts)]) if force else behind(consumer, parts)
    for tp in late:
        if tp.offset >= 0:
            consumer.seek(tp)
    return any(tp.offset >= 0 for tp in late)


def fetched_ends(settings: Mapping[str, Any], reported: Mapping[tuple[str, int], int], *, timeout: float = 60.0,
                 consumer: Consumer | None = None) -> dict[tuple[str, int], int]:  # fmt: skip
    """Each partition's end found by fetching from its reported end minus one to partition EOF (``read_on_batches``
    with ``settings``, by ``consumer`` first if given; it is closed): an end at or past the partition's end when
    ``reported`` was read — its true end, unless it is written to faster than the fetch wait.

    Tansu's ListOffsets answers a multi-record batch's base offset + 1; on Kafka the fetch
    finds the reported end again. Costs one batch per partition, unless the partition is busy:

    A partition written to more often than the fetch wait never reports EOF: every fetch brings something (a feed's
    read of the points topic's end once its wait had grown stalled for its whole timeout). So every ``END_LOOK_S``
    of reading its reported end is looked at again (``EndLooks``); once it has moved on, a later batch has begun,
    and the new reported end minus one (that batch's base on Tansu, at or past the first reported end on Kafka)
    is taken as the partition's end, even below offsets read already: on Tansu it stays a batch's bound.
    """
    ends = dict(reported)
    starts = {at: end - 1 for at, end in reported.items() if end > 0}
    if not starts:
        if consumer is not None:
            consumer.close()
        return ends
    waiting, settled, looks = set(starts), set(), EndLooks(settings, reported)
    try:  # (``waiting`` loses a partition at its EOF before the batch of its last messages comes: not a filter)
        for batch in read_on_batches(settings, starts, timeout=timeout, consumer=consumer, waiting=waiting):
            for msg in batch:
                at = (str(msg.topic()), int(msg.partition() or 0))
                if at not in settled:
                    ends[at] = max(ends[at], int(msg.offset() or 0) + 1)
            for at, end in looks.moved(waiting).items():
                ends[at] = end - 1
                waiting.discard(at)
                settled.add(at)
    finally:
        looks.close()
    return ends


class EndLooks:
    """The reported ends of the partitions a read of their ends still waits on, looked at no more than every
    ``END_LOOK_S`` s (by a reader of its own, made at the first look): which moved on past the first reported."""

    def __init__(self, settings: Mapping[str, Any], reported: Mapping[tuple[str, int], int]) -> None:
        self.settings, self.reported = settings, reported
        self.looked = time.monotonic()
        self.consumer: Consumer | None = None

    def moved(self, waiting: Collection[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The ends reported now of those of ``waiting`` that moved on (none between two looks; a partition the
        broker gives no answer for is read on)."""
        if not waiting or time.monotonic() - self.looked < END_LOOK_S:
            return {}
        self.consumer = self.consumer or reader(self.settings)
        now = {at: self._end(self.consumer, at) for at in waiting}
        self.looked = time.monotonic()
        return {at: end for at, end in now.items() if end > self.reported[at]}

    @staticmethod
    def _end(consumer: Consumer, at: tuple[str, int]) -> int:
        try:
            return int(consumer.get_watermark_offsets(TopicPartition(*at), timeout=ANSWER_S)[1])
        except KafkaException:
            return -1

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()


def bounds(settings: Mapping[str, Any], topic: str, partition: int) -> tuple[int, int]:
    """(first offset, true end) of one partition (``bounds_of``)."""
    return bounds_of(settings, [(topic, partition)])[(topic, partition)]


def bounds_of(settings: Mapping[str, Any], parts: Collection[tuple[str, int]]
              ) -> dict[tuple[str, int], tuple[int, int]]:  # fmt: skip
    """(first offset, true end) of each of ``parts``, read by one ``reader`` of ``settings`` of its own: the
    ends as ``fetched_ends`` finds them, all in one read."""
    consumer = reader(settings)
    try:
        marks = {part: consumer.get_watermark_offsets(TopicPartition(*part), timeout=10) for part in parts}
    except BaseException:
        consumer.close()
        raise
    ends = fetched_ends(settings, {part: int(high) for part, (_, high) in marks.items()}, consumer=consumer)
    return {part: (int(low), ends[part]) for part, (low, _) in marks.items()}


def read_topic(bootstrap: str, topic: str, *, timeout: float = 30.0) -> list[Record]:
    """Every record of ``topic`` (all partitions), in offset order per partition."""
    return list(read_topic_from({"bootstrap.servers": bootstrap}, topic, timeout=timeout))


def read_topic_from(settings: Mapping[str, Any], topic: str, *, timeout: float = 30.0,
                    partitions: Collection[int] | None = None) -> Iterator[Record]:  # fmt: skip
    """``read_topic`` with any librdkafka client settings (security, fetch waits), record by record,
    of every partition or of ``partitions`` (``read_on``)."""
    consumer = reader(settings)
    try:
        found = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    except BaseException:
        consumer.close()
        raise
    starts = {(topic, p): 0 for p in found if partitions is None or p in partitions}
    yield from map(record, read_on(settings, starts, timeout=timeout, consumer=consumer))


def read_on(settings: Mapping[str, Any], starts: dict[tuple[str, int], int], *, timeout: float,
            consumer: Consumer | None = None, bulk: bool = False, idle: bool = False,
            ) -> Generator[Message, None, None]:  # fmt: skip
    """``read_on_batches``, message by message, ``starts`` kept up to date as each is yielded."""
    for batch in read_on_batches(settings, starts, timeout=timeout, consumer=consumer, bulk=bulk, idle=idle):
        for msg in batch:
            starts[(str(msg.topic()), int(msg.partition() or 0))] = int(msg.offset() or 0) + 1
            yield msg


def read_on_batches(settings: Mapping[str, Any], starts: dict[tuple[str, int], int], *, timeout: float,
                    consumer: Consumer | None = None, bulk: bool = False, idle: bool = False,
                    waiting: set[tuple[str, int]] | None = None) -> Iterator[list[Message]]:  # fmt: skip
    """``batches_to_end`` of partitions from offsets (``starts``, moved past each batch once the next is asked for),
    by ``consumer`` (a ``reader`` of ``settings``; one is made if None) and closed at
    the end; a reader that stalls is replaced by a new one from where it stood, with a longer fetch wait when its
    fetches came back empty below the end (``FetchWait``: on the local broker a one-shot read of a long partition
    needs it too). ``bulk``: the read starts far from the end (a whole partition): when a partition read holds more
    than ``BULK_FROM`` records, its made reader's wait starts at ``BULK_WAIT_MS`` at least, not the 10 ms a read at
    the tail wants (see ``BULK_WAIT_MS``). For reads whose work per message is small: a raw topic's keys' read
    took 4.8-5.1 s for 1M changes by batch, 6.3-7.2 s message by message through generators (``read_on``'s and
    those below it; bench/RESULTS.md, 2026-11-29). ``idle``: ``timeout`` counts from the last batch (a whole
    topic read while the caller works on each record), through the readers that replace a stalled one. ``waiting``:
    as ``batches_to_end``'s, kept across those readers."""
    deadline = time.monotonic() + timeout
    waits = {"fetch.wait.max.ms": READER_FETCH_WAIT_MS, **settings}
    wait = FetchWait(waits)
    made, consumer = consumer is None, reader(settings) if consumer is None else consumer
    if bulk and made and _longer(consumer, starts, BULK_FROM):
        consumer.close()
        wait = FetchWait(waits, least=BULK_WAIT_MS)
        consumer = reader(wait.applied(settings))
    try:
        while True:
            try:
                left = timeout if idle else max(deadline - time.monotonic(), 1.0)
                assignments = [TopicPartition(t, p, o) for (t, p), o in starts.items()]
                for batch in batches_to_end(consumer, assignments, timeout=left, wait=wait, idle=idle, waiting=waiting):
                    yield batch
                    starts.update(_past(batch, len(assignments)))
                    deadline = time.monotonic() + timeout if idle else deadline
                return
            except Stalled as exc:
                if idle and time.monotonic() > deadline:
                    raise RetryableError(f"{exc}, and nothing was read for {timeout:.0f} s") from exc
                log.warning("%s: reading on from %s with a new consumer", exc, starts)
                consumer.close()
                consumer = reader(wait.applied(settings))
    finally:
        consumer.close()


def _past(batch: list[Message], partitions: int) -> dict[tuple[str, int], int]:
    """The offset past each partition's last message in ``batch`` (of ``partitions`` partitions at most), read from
    its end: asking every message cost 15% of a script's read of a raw topic's keys."""
    past: dict[tuple[str, int], int] = {}
    for msg in reversed(batch):
        past.setdefault((str(msg.topic()), int(msg.partition() or 0)), int(msg.offset() or 0) + 1)
        if len(past) == partitions:
            break
    return past


def _longer(consumer: Consumer, starts: Mapping[tuple[str, int], int], records: int) -> bool:
    """Whether any of the partitions holds more than ``records`` (its end offset; False when not known)."""
    try:
        return any(consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1] > records for t, p in starts)
    except KafkaException:
        return False


def record(msg: Message) -> Record:
    """A fetched message as a ``Record`` (headers as name, bytes pairs)."""
    raw_headers: list[tuple[str, Any]] = cast(Any, msg.headers()) or []  # librdkafka: (name, bytes) pairs
    headers = tuple((k, v if isinstance(v, bytes) else str(v or "").encode()) for k, v in raw_headers)
    return Record(int(msg.partition() or 0), int(msg.offset() or 0), msg.key(), msg.value(), headers, msg.topic() or "")
