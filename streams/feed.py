"""The raw change topic, read directly in batches by the workers that need it.

Promise: Faust assigns ``<prefix>.changes`` (one partition) to one worker but never
delivers its messages (``streams.profile``): its per-message pipeline moves one to three
thousand messages a second on this kind of machine, librdkafka batches more than ten
times that. While the worker owns the partition, the fan-out's ``Feed`` reads it from the
position ``start()`` returns, in batches of up to ``batch_size`` messages, and hands each
batch, in offset order, to ``handle``; when nothing came within ``wait`` seconds it calls
``idle``. Every worker that holds view partitions reads it with a ``ViewFeed``, together with
the views' points topic (``streams.frontier``). ``stop()`` returns once the batch in hand is
done, so nothing is handled after a revocation returns. A raw topic the broker no longer has
is a ``FatalError`` naming it (the broker was restarted without its data). A batch that fails
is not skipped: a ``FatalError`` goes to ``on_fatal`` and the feed ends; a reader stuck below a
known end (``tables.kafka.Stalled``) is replaced at once, with a longer fetch wait when its fetches
came back empty there (``tables.kafka.FetchWait``: the local broker's fetch sees no further than its
wait lets it); any other error is logged and the feed starts over from ``start()`` (which reloads
its consumer's state) after a pause that doubles up to 30 s while nothing is read, and is 1 s again
once something was.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from streams.cursor import Raw
from streams.errors import GONE, gone
from streams.frontier import HandOff
from tables.errors import FatalError, RetryableError
from tables.kafka import FetchWait, Stalled, StallWatch, reader
from tables.logs import facts

log = logging.getLogger("headwater.streams")
MAX_PAUSE = 30.0


class Follower(threading.Thread):
    """A reader thread that retries what fails (pause doubling to 30 s) and hands a ``FatalError`` to
    ``on_fatal``; ``_follow`` reads until ``stopping`` is set."""

    what = "its topics"

    def __init__(self, name: str, on_fatal: Callable[[FatalError], None]) -> None:
        super().__init__(name=f"headwater-feed-{name}", daemon=True)
        self.label = name
        self.on_fatal = on_fatal
        self.stopping = threading.Event()
        self.progressed = False  # something was read since the last start (resets the pause)

    def stop(self) -> None:
        """Ask the feed to end and wait for the batch in hand (if any)."""
        self.stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()

    def run(self) -> None:
        pause = 1.0
        while not self.stopping.is_set():
            self.progressed = False
            try:
                self._follow()
            except FatalError as exc:
                self.on_fatal(exc)
                return
            except Stalled as exc:  # a new consumer at the stuck offset reads on: no pause
                log.warning("%s: %s; reading on with a new consumer", self.name, exc)
            except Exception:  # anything else: not skipped, tried again
                pause = 1.0 if self.progressed else pause  # the pause grows only while nothing is read
                log.exception("%s: reading %s failed; starting over in %.0f s", self.name, self.what, pause)
                self.stopping.wait(pause)
                pause = min(pause * 2, MAX_PAUSE)

    def _follow(self) -> None:
        raise NotImplementedError


class Feed(Follower):
    def __init__(self, name: str, topic: str, settings: Mapping[str, Any], *, start: Callable[[], int],
                 handle: Callable[[list[Raw]], None], idle: Callable[[], None] = lambda: None,
                 on_fatal: Callable[[FatalError], None], batch_size: int, wait: float) -> None:  # fmt: skip
        super().__init__(name, on_fatal)
        self.topic = self.what = topic
        self.settings, self.fetch_wait = settings, FetchWait(settings)
        self.start_at, self.handle, self.idle = start, handle, idle
        self.batch_size = batch_size
        self.wait = wait
        self.end = 0  # the topic's end as the last fetch reported it (streams.metrics)

    def _follow(self) -> None:
        consumer = reader(self.fetch_wait.applied(self.settings))
        try:
            self._check(consumer)
            position = self.start_at()
            partition = TopicPartition(self.topic, 0, position)
            consumer.assign([partition])
            log.info("%s: reading %s from offset %d", self.name, self.topic, position,
                     extra=facts(topic=self.topic, offset=position))  # fmt: skip
            watch = StallWatch(wait=self.fetch_wait)  # below a known end with nothing: a seek, a new consumer
            while not self.stopping.is_set():
                batch = self._batch(consumer.consume(self.batch_size, self.wait))
                if self.stopping.is_set():
                    return
                self.end = max(self.end, consumer.get_watermark_offsets(partition, cached=True)[1])
                if batch:
                    self.handle(batch)
                    self.progressed = True
                    watch.seen()
                    continue
                self.idle()
                watch.check(consumer, {(self.topic, 0)})
        finally:
            consumer.close()

    def _check(self, consumer: Any) -> None:
        """The topic still exists (it did when this worker was assigned it); else ``gone``."""
        try:
            found = consumer.list_topics(self.topic, timeout=10).topics.get(self.topic)
        except KafkaException as exc:
            raise RetryableError(f"cannot reach Kafka to read {self.topic}: {exc}") from exc
        if found is None or (found.error is not None and found.error.code() in GONE) or not found.partitions:
            raise gone(self.topic, "unknown topic")

    def _batch(self, messages: list[Any]) -> list[Raw]:
        out: list[Raw] = []
        for m in messages:
            error = m.error()
            if error is None:
                out.append((m.offset(), m.key(), m.value()))
            elif error.code() in GONE:
                raise gone(self.topic, error.str())
            elif error.code() != KafkaError._PARTITION_EOF:
                raise RetryableError(f"reading {self.topic}: {error}")
        return out


class ViewFeed(Feed):
    """The views' feed: the raw topic and the points topic (``streams.frontier``) with one consumer.

    ``handle(raw, points)`` gets the raw changes and the points records' values read; the points
    topic is read from its last ``POINTS_BACK`` records (the barrier as it stands) before the end the broker
    reports (the local broker's can be a batch short: a few more records are read then; a read to the true end,
    as before, waited out the reader's fetch wait, 100 ms on the local broker, at every quiet start), the raw
    topic from ``start()``. While ``crowded()`` (the changes read ahead of the barrier are many: the raw
    partition's owner is away), the raw topic is paused. The points records the announcer beside it
    hands over (``handoff``, when this worker owns the raw partition too) go to ``handle`` after the
    next read returns; their copies read back are dropped.
    """

    POINTS_BACK = 100

    def __init__(self, name: str, topic: str, points_topic: str, settings: Mapping[str, Any], *,
                 start: Callable[[], int], handle: Callable[[list[Raw], list[bytes]], None],
                 idle: Callable[[], None], crowded: Callable[[], bool], on_fatal: Callable[[FatalError], None],
                 batch_size: int, wait: float, handoff: HandOff | None = None) -> None:  # fmt: skip
        super().__init__(name, topic, settings, start=start, handle=lambda batch: None, idle=idle, on_fatal=on_fatal,
                         batch_size=batch_size, wait=wait)  # fmt: skip
        self.points_topic, self.handle_both, self.crowded = points_topic, handle, crowded
        self.handoff = handoff or HandOff()

    def _follow(self) -> None:
        consumer = reader(self.fetch_wait.applied(self.settings))
        try:
            self._check(consumer)
            position = self.start_at()
            low, end = consumer.get_watermark_offsets(TopicPartition(self.points_topic, 0), timeout=10)
            raw = TopicPartition(self.topic, 0, position)
            consumer.assign([raw, TopicPartition(self.points_topic, 0, max(low, end - self.POINTS_BACK))])
            log.info("%s: reading %s from offset %d", self.name, self.topic, position,
                     extra=facts(topic=self.topic, offset=position))  # fmt: skip
            self._read(consumer, raw)
        finally:
            consumer.close()

    def _read(self, consumer: Any, raw: TopicPartition) -> None:
        watch, paused = StallWatch(wait=self.fetch_wait), False
        while not self.stopping.is_set():
            changes, read = self._split(consumer.consume(self.batch_size, self.wait))
            if self.stopping.is_set():
                return
            points = self.handoff.take(read)
            self.end = max(self.end, consumer.get_watermark_offsets(raw, cached=True)[1])
            if changes or points:
                self.handle_both(changes, points)
                watch.seen()
            else:  # the points partition grows too: its fetches may need a longer wait as well
                self.idle()
                watch.check(consumer, {(self.points_topic, 0), *(() if paused else [(self.topic, 0)])})
            if self.crowded() != paused:
                paused = not paused
                (consumer.pause if paused else consumer.resume)([TopicPartition(self.topic, 0)])

    def _split(self, messages: list[Any]) -> tuple[list[Raw], list[bytes]]:
        changes, points = [], []
        for m in messages:
            error = m.error()
            if error is None:
                if m.topic() == self.topic:
                    changes.append((m.offset(), m.key(), m.value()))
                elif m.value() is not None:
                    points.append(m.value())
            elif error.code() in GONE:
                raise gone(str(m.topic()), error.str())
            elif error.code() != KafkaError._PARTITION_EOF:
                raise RetryableError(f"reading {m.topic()}: {error}")
        return changes, points

