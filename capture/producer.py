"""The Kafka side of capture: an idempotent producer and the LSN it is safe to confirm.

Promise: messages go out with acks=all and idempotence (librdkafka), in the order
they were sent. ``mark(lsn)`` records a commit boundary after the messages of that
commit; ``acked_lsn()`` is the newest boundary whose every earlier message Kafka
acknowledged — the only LSN the slot may be told. A delivery failure is kept and
raised as ``BrokerError`` by the next call, so nothing after it is confirmed.
``silence(now)`` says since when Kafka does not answer (no broker connection, from
librdkafka's statistics; or messages waiting with no acknowledgement for ``STALL_AFTER``
seconds), and ``on_wait`` is called about once a second while a send waits for room in
the full local queue — so capture watches Kafka even while it cannot hand it anything.
``send_chunk`` sends a backfill's chunk through a second producer driven from C
(``capture._copier.Sender``, no Python per message) without breaking the order: what the
first producer sent is acknowledged once, before the session's first chunk, and from then on
the stream's messages go through the second producer too, behind the chunks (one idempotent
producer keeps one partition's order), so neither waits for Kafka between chunks.
``sized`` fits the producers' batches under the raw topic's ``max.message.bytes`` (which
``ensure_changes_topic`` reads, and sets to 8 MiB on a topic it makes): fewer, larger requests.
librdkafka's own lines, of every client here (``SnapshotSender`` included), go to the
``tables.logs.KAFKA_LOGGER`` logger, where its connection noise is gated.
On the local broker (``broker_profile = tansu``) the stream's producer lingers ``TANSU_LINGER_MS``
instead of 5 ms: Tansu 0.6.0 lists every record batch of a partition for each fetch that finds
records (its object-store engine keeps one object per batch), so a reader's cost grows with the raw
topic's batches. At 5 ms a steady load writes up to 200 batches a second, and at 300 transactions a
second the broker filled a core within a minute (``bench/RESULTS.md``); 50 ms writes a tenth of them.
The C senders of snapshot and backfill chunks keep 5 ms: each chunk's last batch would wait the
linger, and a backfill waits for its chunks in turn (2.3 s more a million rows at 50 ms).
"""

from __future__ import annotations

import ctypes.util
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from capture._copier import Sender, send_envelopes
from capture.config import CaptureConfig
from capture.errors import BrokerError, SourceError, TopicLostError
from tables.config import Settings
from tables.errors import FatalError
from tables.kafka import create_topics, partition_counts
from tables.logs import KAFKA_GATE, KAFKA_LOGGER, unreachable

BrokerErrorT = TypeVar("BrokerErrorT", BrokerError, SourceError)
log = logging.getLogger("headwater.capture")
kafka_log = logging.getLogger(KAFKA_LOGGER)
STALL_AFTER = 2.0  # seconds messages may wait with no acknowledgement before Kafka counts as not answering
WAIT_REPORT = 1.0  # seconds between calls of ``on_wait`` while a send waits for room
ROOM_EVERY = 1_000  # the stream's messages sent through the chunks' producer between looks for room
CHUNK_SLICE = 10_000  # a backfill chunk's messages handed to its sender at once (room for them awaited first)
# The raw topic's limit on a record batch, set when capture makes the topic: room for BIG_BATCH. Apache Kafka's
# default (message.max.bytes, 1,048,588) would refuse such a batch and stop capture; 8 MiB is also the most
# Confluent Cloud's standard clusters accept.
RAW_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
BIG_BATCH = 4 * 1024 * 1024  # bytes of a producer batch where the topic takes it: a backfill of narrow rows
# needs 5x fewer produce requests than at librdkafka's 1 MB, and the local broker takes ~15% more rows/s
BIG_BATCH_MESSAGES = 100_000

DEFAULTS = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,  # a commit reaches Kafka within ~5 ms at low rates; batches fill by size under load
    "batch.num.messages": 10000,
    "queue.buffering.max.messages": 200000,
    "queue.buffering.max.kbytes": 64 * 1024,  # bounds memory while a big transaction drains
    "message.timeout.ms": 300000,
    # a tenth of the broker's work per message (the envelope's table and topic names repeat); cheap
    # for librdkafka, and every reader here has lz4 (librdkafka; aiokafka through cramjam)
    "compression.type": "lz4",
    # the raw topic is made by ensure_changes_topic, never by a broker's auto-create (which would give
    # it the broker's default partitions, or re-create it empty after the broker lost it)
    "allow.auto.create.topics": False,
}


TANSU_LINGER_MS = 50  # the local broker: fewer, larger batches on the raw topic (see the promise)


def producer_settings(cfg: CaptureConfig, *, stream: bool = False) -> dict[str, Any]:
    """librdkafka settings of capture's clients; ``stream``: the stream's own producer, which lingers
    longer on the local broker (the C senders of snapshot and backfill chunks do not: a chunk's last
    batch would wait the linger, and a backfill waits for each chunk in turn)."""
    # librdkafka's own log lines go through Python logging (served by poll), not straight to stderr
    return {
        "bootstrap.servers": cfg.bootstrap,
        **DEFAULTS,
        **({"linger.ms": TANSU_LINGER_MS} if stream and cfg.tansu else {}),
        **cfg.producer,
        "logger": kafka_log,
    }


def librdkafka_settings(cfg: CaptureConfig) -> dict[str, str]:
    """``producer_settings`` as librdkafka's own text properties (what a ``Sender`` is made from)."""
    out = {}
    for name, value in producer_settings(cfg).items():
        if name == "logger":
            continue
        if not isinstance(value, (str, int, float)):
            raise FatalError(f"producer setting {name} must be text or a number (a librdkafka property)")
        out[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def librdkafka_library() -> str | None:
    """The librdkafka confluent-kafka loaded: the one its wheel ships beside the package, else the
    system's (what a confluent-kafka built from source links to); None if neither is found."""
    libs = Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs"
    found = sorted(libs.glob("librdkafka*.so*"))
    if len(found) == 1:
        return str(found[0])
    return ctypes.util.find_library("rdkafka")


# librdkafka's syslog levels as logging's (as confluent-kafka maps them for its ``logger``)
SYSLOG = {0: logging.CRITICAL, 1: logging.CRITICAL, 2: logging.CRITICAL, 3: logging.ERROR, 4: logging.WARNING,
          5: logging.INFO, 6: logging.INFO, 7: logging.DEBUG}  # fmt: skip


def librdkafka_line(level: int, text: str) -> None:
    """A line of a ``Sender``'s librdkafka (its log and its non-fatal errors), as the process logs."""
    kafka_log.log(SYSLOG.get(level, logging.WARNING), "%s", text)


class SnapshotSender:
    """A snapshot worker's producer: ``capture._copier.Sender``, which the Copier drives from C
    (no Python per message). Same settings and guarantees as ``ChangeProducer``; a failed delivery
    or fatal error is raised as ``BrokerError`` (with ``failed_deliveries``) by the next send or by
    ``flush``."""

    def __init__(self, cfg: CaptureConfig, library: str) -> None:
        self.handle = Sender(library, librdkafka_settings(cfg), cfg.changes_topic, BrokerError, librdkafka_line)

    @classmethod
    def open(cls, cfg: CaptureConfig) -> SnapshotSender | None:
        """A sender on confluent-kafka's librdkafka, or None when that library cannot be found."""
        library = librdkafka_library()
        return cls(cfg, library) if library else None

    def check(self) -> None:
        failure = self.handle.failure
        if failure:
            raise failed(BrokerError(failure, hint="the snapshot starts over on the next run"), self.handle.errors)

    def flush(self, timeout: float = 60.0) -> None:
        remaining = self.handle.flush(timeout)
        self.check()
        if remaining:
            raise BrokerError(f"{remaining} messages not acknowledged by Kafka after {timeout:.0f} s")

    def close(self) -> None:
        self.handle.close()


def failed(exc: BrokerErrorT, deliveries: int) -> BrokerErrorT:
    """``exc`` carrying how many deliveries failed (``headwater_capture_delivery_errors_total``)."""
    exc.failed_deliveries = deliveries
    return exc


def ensure_changes_topic(cfg: CaptureConfig, *, written: bool = False) -> int | None:
    """Create ``<prefix>.changes`` with one partition (taking batches of ``RAW_MAX_MESSAGE_BYTES`` unless
    ``topic_config`` says otherwise); refuse an existing one with more, and a missing one that capture already
    ``written`` to (``TopicLostError``: the broker lost it). Returns the topic's ``max.message.bytes``, if known."""
    settings: dict[str, Any] = {"bootstrap.servers": cfg.bootstrap, **cfg.producer, "logger": kafka_log}
    admin = AdminClient(settings)
    try:
        existing = partition_counts(admin).get(cfg.changes_topic)
    except KafkaException as exc:
        raise BrokerError(
            f"cannot reach Kafka at {cfg.bootstrap}: {exc}",
            hint="start the broker or set bootstrap in [pipeline] or [capture]",
        ) from exc
    if existing is not None:
        if existing != 1:
            raise FatalError(
                f"topic {cfg.changes_topic} has {existing} partitions; the raw change topic needs 1",
                hint="delete it or choose another topic_prefix: total commit order needs a single partition",
            )
        return topic_limit(admin, cfg.changes_topic)
    if written:
        raise TopicLostError(cfg.changes_topic, cfg.slot, str(cfg.state_dir / f"{cfg.slot}.sqlite"))
    config = {"cleanup.policy": "delete", "max.message.bytes": str(RAW_MAX_MESSAGE_BYTES), **cfg.topic_config}
    try:
        create_topics(admin, [NewTopic(cfg.changes_topic, 1, cfg.replication_factor, config=config)])
    except KafkaException as exc:
        raise BrokerError(f"cannot create topic {cfg.changes_topic}: {exc}") from exc
    return topic_limit(admin, cfg.changes_topic)


def topic_limit(admin: AdminClient, topic: str) -> int | None:
    """The ``max.message.bytes`` ``topic`` reports (None when it reports none, as the local broker does for
    a setting never made, or when describing topics is not allowed)."""
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    try:
        entries = admin.describe_configs([resource])[resource].result(timeout=30)
    except (KafkaException, TimeoutError) as exc:
        log.info("cannot read %s's max.message.bytes (%s): producer batches keep librdkafka's size", topic, exc)
        return None
    entry = entries.get("max.message.bytes")
    return int(entry.value) if entry is not None and entry.value else None


def batch_settings(limit: int | None) -> dict[str, str]:
    """Producer batch settings under a topic's ``max.message.bytes`` ``limit``: batches of up to
    ``BIG_BATCH`` bytes before compression (lz4 makes them smaller, or at worst a few bytes per 64 KiB
    larger), a sixteenth of the limit kept for that and framing; none for an unknown limit (librdkafka's
    1 MB batches, which Kafka's default accepts)."""
    if limit is None:
        return {}
    size = max(min(BIG_BATCH, limit - limit // 16), 1)
    return {
        "batch.size": str(size),
        "batch.num.messages": str(BIG_BATCH_MESSAGES),
        "message.max.bytes": str(max(size + 64 * 1024, 1_000_000)),  # the request: one batch and its framing
    }


def sized(cfg: CaptureConfig, limit: int | None) -> CaptureConfig:
    """``cfg`` with producer batches sized for the raw topic's ``limit``; settings the user made win."""
    batches = batch_settings(limit)
    if not batches:
        return cfg
    chosen = {k: v for k, v in batches.items() if k not in cfg.producer}
    if "batch.size" in chosen:
        log.info("raw topic %s takes batches of up to %d bytes: sending batches of up to %s bytes",
                 cfg.changes_topic, limit, chosen["batch.size"])  # fmt: skip
    return replace(cfg, producer=Settings({**chosen, **cfg.producer}))


def statistics(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with librdkafka's statistics every second (broker connection states, for "does Kafka
    answer"), unless they set ``statistics.interval.ms`` themselves (0: capture then judges by acks alone)."""
    return {"statistics.interval.ms": 1000, **settings}


class ChangeProducer:
    """Sends raw-topic messages; knows how far Kafka acknowledged them, in send order.

    No Python callback runs per message: librdkafka reports only failed deliveries,
    and since the idempotent producer delivers one partition's messages in order,
    everything sent minus what is still queued or in flight has been acknowledged. That holds
    across the two producers too: the first backfill chunk waits until the first one is
    acknowledged, and from then on only the chunks' producer is sent to, until ``unroute`` (no
    backfill left, the chunks' producer all acknowledged) hands the stream back to the first.
    """

    def __init__(self, cfg: CaptureConfig) -> None:
        self.topic = cfg.changes_topic
        self.cfg = cfg
        self.chunks: Sender | None = None  # the backfills' chunks' own producer (``chunk_sender``, at session start)
        self.routed = False  # a chunk went through ``chunks``: everything after it goes there too, in order
        self._folded = 0  # ``chunks``' failed deliveries already counted in ``delivery_errors``
        settings = producer_settings(cfg, stream=True)
        self.producer = Producer(
            {
                **statistics(settings),
                "error_cb": self._on_error,
                "on_delivery": self._on_failed_delivery,
                "delivery.report.only.error": True,
                "stats_cb": self._on_stats,
            }
        )
        self.queue_max = int(settings.get("queue.buffering.max.messages", 100000))
        self._sent = 0
        self._pending = 0  # messages a ``send_all`` still running handed over (it adds them to _sent at its end)
        self._marks: deque[tuple[int, int]] = deque()
        self._last_acked_lsn: int | None = None
        self.failure: str | None = None
        self.delivery_errors = 0
        self.brokers_up: bool | None = None  # from librdkafka's statistics: a broker connection is up
        self._down_since: float | None = None  # when the statistics first said no broker connection is up
        self._progress = (0, time.monotonic())  # (most messages acknowledged yet, since when it last grew)
        self.on_wait: Callable[[float], None] | None = None  # called ~1/s while a send waits for room

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self.failure = f"fatal producer error: {err}"
        elif unreachable(err.str()):
            KAFKA_GATE.seen(err.str())  # repeated while the broker is away: capture.metrics says it once
        else:
            log.warning("kafka: %s", err)

    def _on_stats(self, stats: str) -> None:
        brokers = json.loads(stats).get("brokers") or {}
        self.brokers_up = any(b.get("state") == "UP" for b in brokers.values())
        if self.brokers_up:
            self._down_since = None
        elif self._down_since is None:
            self._down_since = time.monotonic()

    def _on_failed_delivery(self, err: KafkaError | None, _msg: Any) -> None:
        if err is None:
            return
        self.delivery_errors += 1
        if self.failure is None:
            self.failure = f"delivery to {self.topic} failed: {err}"

    def waiting(self) -> int:
        """Messages sent and not yet acknowledged by Kafka (by either producer: only one holds any)."""
        return len(self.producer) + (len(self.chunks) if self.chunks is not None else 0)

    @property
    def sent(self) -> int:
        """Messages handed to librdkafka by this producer so far."""
        return self._sent + self._pending

    def acknowledged(self) -> int:
        """Messages Kafka acknowledged so far: sent, minus those still waiting (a failed one waits until its
        report is served, which counts it in ``delivery_errors``), minus those that failed."""
        return self.sent - self.waiting() - self.delivery_errors

    def unanswered(self, now: float) -> float:
        """Seconds messages have been waiting with no acknowledgement at all (0 when none wait or acks move).
        Acks move when the count passes its highest yet: librdkafka's queue length also counts the events
        waiting to be served (its log lines, errors, statistics), which come and go while Kafka is away."""
        waiting = self.waiting()
        acked = self.sent - waiting
        if not waiting or acked > self._progress[0]:
            self._progress = (max(acked, self._progress[0]), now)
            return 0.0
        return now - self._progress[1]

    def silence(self, now: float) -> tuple[float, str] | None:
        """(since when, what shows it) while Kafka does not answer — no broker connection up, or messages
        waiting ``STALL_AFTER`` seconds with no acknowledgement — else None. Called from one thread."""
        if self.brokers_up is False and self._down_since is not None:
            return self._down_since, f"no broker connection: {KAFKA_GATE.last()[2] or 'none up'}"
        waited = self.unanswered(now)
        if waited >= STALL_AFTER:
            return now - waited, "no acknowledgement of the messages sent"
        return None

    def send(self, key: bytes, value: bytes) -> None:
        if self.routed:
            self._send_routed(((key, value),))
            return
        try:
            self.producer.produce(self.topic, value, key)
        except BufferError:
            self._produce_when_room(key, value, 0)
        except KafkaException as exc:
            raise self._refused(exc) from exc
        self._sent += 1

    def send_all(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """``send`` each (key, value), in order (one transaction's messages: the hot path)."""
        if self.routed:
            self._send_routed(records)
            return
        produce, topic, sent = self.producer.produce, self.topic, 0
        try:
            for key, value in records:
                try:
                    produce(topic, value, key)
                except BufferError:
                    self._produce_when_room(key, value, sent)
                sent += 1
        except KafkaException as exc:
            raise self._refused(exc) from exc
        finally:
            self._sent += sent

    def _refused(self, exc: KafkaException) -> BrokerError:
        """librdkafka refused a message: its producer is in a fatal state (e.g. the broker lost its
        producer ids when it restarted); the session ends and a new producer resumes from the slot."""
        return BrokerError(f"cannot send to {self.topic}: {self.failure or exc}",
                           hint="capture resumes from the last confirmed commit with a new producer")  # fmt: skip

    def abandon(self) -> None:
        """End of a session: drop what is still queued (the next session resends it from the slot)."""
        if self.chunks is not None:
            self.chunks.close()
        try:
            self.producer.purge(in_queue=True, in_flight=False, blocking=False)
            self.producer.poll(0)
        except KafkaException as exc:
            log.debug("purging the producer: %s", exc)

    def send_batch(self, messages: list[dict[str, Any]]) -> None:
        """``send`` each of ``messages`` (``{"value", "key"}`` dicts) with one call into librdkafka.

        Waits for room in the local queue first. A message the queue still refuses (its byte
        limit) is sent again after the others, so only then is the batch's order not kept:
        this is for the snapshot's READ rows, whose positions identify them.
        """
        if self.routed:
            self._send_routed((m["key"], m["value"]) for m in messages)
            return
        told = time.monotonic()
        while len(self.producer) and len(self.producer) + len(messages) > self.queue_max:
            self.producer.poll(0.05)
            self.check()
            told = self._waiting(told)
        queued = self.producer.produce_batch(self.topic, messages, partition=0)
        self._sent += queued
        if queued == len(messages):
            return
        for message in messages:
            err = message.get("_error")
            if err is None:
                continue
            if err.code() != KafkaError._QUEUE_FULL:
                raise BrokerError(f"cannot send to {self.topic}: {err}")
            self.send(message["key"], message["value"])

    def chunk_sender(self) -> Sender | None:
        """The chunks' producer (``send_chunk``), or None when confluent-kafka's librdkafka cannot be found."""
        if self.chunks is None:
            library = librdkafka_library()
            if library is None:
                return None
            self.chunks = Sender(library, librdkafka_settings(self.cfg), self.topic, BrokerError, librdkafka_line)
            self.chunks.open()  # the topic exists (the stream writes it): connected before the first chunk
        return self.chunks

    def settle(self) -> None:
        """``flush`` for as long as a message may take to be acknowledged (``message.timeout.ms``)."""
        self.flush(float(producer_settings(self.cfg).get("message.timeout.ms", 300000)) / 1000)

    def send_chunk(self, sender: Sender, kafka_key: bytes, head: bytes, size: bytes,
                   rows: list[tuple[bytes | None, bytes | None]], tail: bytes, nested: bool) -> None:  # fmt: skip
        """A backfill chunk's changes (``capture._copier.send_envelopes``) through ``sender`` (C, no Python per
        message), after everything sent before and before anything sent after. The session's first chunk waits
        until the first producer's messages are acknowledged; then the stream's messages go through ``sender`` as
        well (``routed``), so later chunks and the messages around them wait for nothing but room in its queue."""
        if not self.routed:
            self.settle()
            self.routed = True
        told = self._below(sender, len(rows), time.monotonic())  # one chunk in flight at most, while this one goes in
        for first in range(0, len(rows), CHUNK_SLICE):
            told = self._room(sender, CHUNK_SLICE, told)
            send_envelopes(sender, kafka_key, head, size, rows[first : first + CHUNK_SLICE], tail, first, nested)
            self._sent += min(CHUNK_SLICE, len(rows) - first)

    def unroute(self) -> None:
        """No backfill is left: the stream's messages go back to its own producer (which lingers on the local
        broker, ``producer_settings``), once everything sent through the chunks' producer is acknowledged (else
        they stay routed: the order holds either way). Without this, one backfill left the stream on the chunks'
        5 ms linger for the rest of the session, writing a batch per commit into a broker whose reads cost more
        with every batch (README, "The local stack")."""
        if self.routed and self.chunks is not None and not len(self.chunks) and not self._failed():
            self.routed = False

    def _send_routed(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """The stream's messages once chunks went through ``chunks``: behind them, by the same producer."""
        sender = self.chunks
        assert sender is not None
        send, told = sender.send, time.monotonic()
        for n, (key, value) in enumerate(records):
            if n % ROOM_EVERY == 0:
                told = self._room(sender, ROOM_EVERY, told)
            send(value, key)
            self._sent += 1

    def _room(self, sender: Sender, count: int, told: float) -> float:
        """Wait until ``sender``'s queue has room for ``count`` more messages, or is empty when it holds fewer
        (a send into a full queue then waits in C)."""
        return self._below(sender, max(self.queue_max - count, 0), told)

    def _below(self, sender: Sender, limit: int, told: float) -> float:
        """Wait until ``sender`` holds at most ``limit`` messages not acknowledged (``on_wait`` meanwhile)."""
        while len(sender) > limit and not (sender.failure or self._failed()):
            sender.poll(0.005)
            told = self._waiting(told)
        self.check()
        return told

    def _produce_when_room(self, key: bytes, value: bytes, pending: int) -> None:
        """The local queue is full: serve deliveries until the message fits (``pending``: messages the
        calling ``send_all`` handed over so far, not yet in ``_sent``)."""
        self._pending, told = pending, time.monotonic()
        try:
            while True:
                self.producer.poll(0.05)
                self.check()
                try:
                    self.producer.produce(self.topic, value, key)
                    return
                except BufferError:
                    told = self._waiting(told)
                except KafkaException as exc:
                    raise self._refused(exc) from exc
        finally:
            self._pending = 0

    def _waiting(self, told: float) -> float:
        """While a send waits for room: ``on_wait`` once ``WAIT_REPORT`` seconds passed since ``told``, after the
        stream's producer served its statistics (``silence``: whether a broker connection is up; while a
        backfill's chunks wait, nothing else polls it)."""
        now = time.monotonic()
        if self.on_wait is None or now - told < WAIT_REPORT:
            return told
        self.producer.poll(0)
        self.on_wait(now)
        return now

    def mark(self, lsn: int) -> None:
        """A commit boundary: ``lsn`` may be confirmed once everything sent so far is acked."""
        self._marks.append((self._sent, lsn))

    def acked_lsn(self) -> int | None:
        self.poll(0)
        self.check()
        acked = self.acknowledged()
        while self._marks and self._marks[0][0] <= acked:
            self._last_acked_lsn = self._marks.popleft()[1]
        return self._last_acked_lsn

    def check(self) -> None:
        chunks = self.chunks
        if chunks is not None and chunks.errors > self._folded:
            self.delivery_errors += chunks.errors - self._folded
            self._folded = chunks.errors
        if self.failure is None and chunks is not None and chunks.failure:
            self.failure = f"a backfill's producer: {chunks.failure}"
        if self.failure:
            raise BrokerError(self.failure, hint="capture resumes from the last confirmed commit once Kafka is back"
                              " (a backfill from its last acknowledged chunk)")  # fmt: skip

    def _failed(self) -> bool:
        return bool(self.failure or (self.chunks is not None and self.chunks.failure))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until Kafka acknowledged everything sent (``on_wait`` about once a second meanwhile)."""
        told = start = time.monotonic()
        remaining = 0
        for handle in (self.producer, self.chunks):
            while handle is not None and not self._failed():
                remaining = handle.flush(max(min(WAIT_REPORT, start + timeout - time.monotonic()), 0))
                if not remaining or time.monotonic() >= start + timeout:
                    break
                told = self._waiting(told)
        self.check()
        if remaining:
            raise BrokerError(f"{remaining} messages not acknowledged by Kafka after {timeout:.0f} s")

    def poll(self, timeout: float = 0.0) -> None:
        self.producer.poll(timeout)
        if self.chunks is not None:
            self.chunks.poll(0)
